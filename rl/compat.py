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
