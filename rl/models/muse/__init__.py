"""Muse Spark Open, text decoder: config and torch model, registered with transformers' Auto classes on import.

On disk the experts are per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, like Qwen3-MoE
checkpoints); in memory they are fused (`mlp.experts.gate_up_proj` [E, 2I, latent], `down_proj`
[E, latent, I]). transformers' conversion mapping does both directions, as it does for Qwen3-MoE.
"""

from __future__ import annotations

from rl.models.muse.configuration_muse import MuseSparkConfig, muse_layer_types
from rl.models.muse.modeling_muse import (
    MuseSparkForCausalLM,
    MuseSparkModel,
    MuseSparkPreTrainedModel,
    MuseSparkTopKRouter,
)

MODEL_TYPE = MuseSparkConfig.model_type


def _register() -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    AutoConfig.register(MODEL_TYPE, MuseSparkConfig, exist_ok=True)
    AutoModel.register(MuseSparkConfig, MuseSparkModel, exist_ok=True)
    AutoModelForCausalLM.register(MuseSparkConfig, MuseSparkForCausalLM, exist_ok=True)
    # Same per-expert <-> fused expert conversion as Qwen3-MoE (its experts share our parameter names).
    register_checkpoint_conversion_mapping(
        MODEL_TYPE, get_checkpoint_conversion_mapping("qwen3_moe"), overwrite=True
    )


_register()

__all__ = [
    "MODEL_TYPE",
    "MuseSparkConfig",
    "MuseSparkForCausalLM",
    "MuseSparkModel",
    "MuseSparkPreTrainedModel",
    "MuseSparkTopKRouter",
    "muse_layer_types",
]
