"""Muse Spark Open (docs/design.md, Models): the family transformers and vLLM lack.

- configuration_muse.py, modeling_muse.py: the text decoder as the trainer runs it (transformers
  conventions), registered with transformers' Auto classes by `register_hf`;
- vllm_muse.py: the same decoder in vLLM, registered by vLLM's plugin (rl.models.register_vllm_models);
- shape.py: the planner's facts;
- `FAMILY` below: the registry entry (router replay, tiny model, quantization, the registration hooks).

On disk the experts are per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, like Qwen3-MoE
checkpoints); in memory they are fused (`mlp.experts.gate_up_proj` [E, 2I, latent], `down_proj`
[E, latent, I]). transformers' conversion mapping does both directions, as it does for Qwen3-MoE.

Importing this package imports no torch: the transformers classes below (`from rl.models.muse import
MuseSparkConfig`) load on first use, registered with the Auto classes then.
"""

from __future__ import annotations

import importlib

from rl.models.family import BuiltinModel, Family, PlannerFacts, Router, TinyModel
from rl.models.muse import shape

MODEL_TYPE = "muse_spark"

FAMILY = Family(
    name="muse",
    model_types=(MODEL_TYPE,),
    # The Muse router implements its own replay (the same output triple as Qwen3-MoE's router).
    routers=(
        Router(
            cls="rl.models.muse:MuseSparkTopKRouter",
            adapter="rl.models.muse:MuseSparkTopKRouter.replay_output",
        ),
    ),
    planner=PlannerFacts(
        config_fields=shape.config_fields,
        builtin=(
            BuiltinModel(
                name="Muse Spark Open",
                match="muse",
                source="built-in facts from the design doc; the vision tower and audio encoder are not trained "
                "and left out",
                shape=shape.PUBLISHED,
            ),
        ),
    ),
    # 8 layers so the 3-sliding-then-1-full cycle shows (full: layers 3 and 7); a 16-token window so sliding
    # attention changes prompts the tests use.
    tiny=TinyModel(
        arch="muse",
        config="rl.models.muse:MuseSparkConfig",
        kwargs={
            "head_dim": 32,
            "moe_latent_size": 64,
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "num_hidden_layers": 8,
        },
    ),
    # The attention head gate (`g_proj`) has one output a head (96, or 4 in the tiny model): too few rows for
    # the FP4 GEMM tiles (Marlin works in multiples of 64), and at 0.8M weights a layer nothing to save.
    quantize_ignore=("re:.*self_attn.g_proj$",),
    register_hf="rl.models.muse:register_hf",
    vllm_models={"MuseSparkForCausalLM": "rl.models.muse.vllm_muse:MuseSparkForCausalLM"},
)

# name -> the module of this package that defines it (loaded on first use)
_HF_NAMES = {
    "MuseSparkConfig": "configuration_muse",
    "muse_layer_types": "configuration_muse",
    "MuseSparkForCausalLM": "modeling_muse",
    "MuseSparkModel": "modeling_muse",
    "MuseSparkPreTrainedModel": "modeling_muse",
    "MuseSparkTopKRouter": "modeling_muse",
}
_registered = False


def register_hf() -> None:
    """Muse Spark's config and models with transformers' Auto classes, and its checkpoint conversion
    (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    from rl.models.muse.configuration_muse import MuseSparkConfig
    from rl.models.muse.modeling_muse import MuseSparkForCausalLM, MuseSparkModel

    AutoConfig.register(MODEL_TYPE, MuseSparkConfig, exist_ok=True)
    AutoModel.register(MuseSparkConfig, MuseSparkModel, exist_ok=True)
    AutoModelForCausalLM.register(MuseSparkConfig, MuseSparkForCausalLM, exist_ok=True)
    # Same per-expert <-> fused expert conversion as Qwen3-MoE (its experts share our parameter names).
    register_checkpoint_conversion_mapping(
        MODEL_TYPE, get_checkpoint_conversion_mapping("qwen3_moe"), overwrite=True
    )
    _registered = True


def __getattr__(name: str):
    module = _HF_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_hf()
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HF_NAMES])


__all__ = ["FAMILY", "MODEL_TYPE", "register_hf", *_HF_NAMES]
