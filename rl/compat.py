"""Small helpers that hide differences between library versions; one function per difference."""

from __future__ import annotations


def hf_checkpoint_state_dict(model, state_dict: dict) -> dict:
    """A transformers model's in-memory state dict -> the key names and layout its checkpoints use on disk
    (transformers >= 5 fuses some weights on load, e.g. Qwen3-MoE's per-expert gate/up/down projections into
    `mlp.experts.gate_up_proj` [E, 2I, H]; `save_pretrained` splits them again). Older versions stored
    what they held."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: no load-time conversion to revert
        return dict(state_dict)
    return revert_weight_conversion(model, dict(state_dict))


def vllm_fused_moe_factory():
    """vLLM's fused-MoE constructor (router + experts + runner; same arguments in both versions): named
    `FusedMoE` in vLLM 0.26 and `FusedMoEFactory` from 0.30 on."""
    from vllm.model_executor.layers import fused_moe

    factory = getattr(fused_moe, "FusedMoEFactory", None)
    return factory if factory is not None else fused_moe.FusedMoE
