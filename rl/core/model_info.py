"""Facts about a checkpoint and about vLLM that the planner (rl/plan.py), the preflight (rl/preflight.py) and
the rollout side (rollout/worker.py) read: vLLM's LoRA ranks, the expert count under its several config
names (whether a model is a mixture of experts), and the kind of quantization a `quantization_config`
describes.

Plain Python on config dicts (no transformers or vLLM import), so the planner stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# vLLM accepts only these LoRA ranks as `max_lora_rank` (vllm.config.lora.MaxLoRARanks, 0.26 and 0.30).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The expert count's name in Qwen3-MoE / Muse, Mixtral, DeepSeek-style and ERNIE-style configs: the one list
# every reader of a config.json asks.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def vllm_lora_rank(rank: int) -> int | None:
    """The smallest rank vLLM accepts that holds `rank`; None above vLLM's largest."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def num_experts(text_config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer of a (text) config dict; 0 for a dense model. A list (a count a
    modality, as ERNIE-VL's `moe_num_experts`) gives its largest."""
    count = next((text_config[k] for k in EXPERT_COUNT_KEYS if text_config.get(k)), 0)
    return int(max(count) if isinstance(count, list | tuple) else count or 0)


def is_moe(config: Mapping[str, Any]) -> bool:
    """Whether a config.json (dict) describes a mixture-of-experts model: an expert count at its top level
    or in its `text_config`."""
    return any(num_experts(c) for c in (config, config.get("text_config") or {}))


def quantization_kind(quant: Any) -> str | None:
    """'nvfp4' for an NVFP4 compressed-tensors config, else its quant_method, or None when unquantized.
    `quant` is a config.json `quantization_config` dict or a transformers quantization config object."""
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        quant = quant.to_dict()
    formats = [quant.get("format")] + [
        g.get("format") for g in (quant.get("config_groups") or {}).values() if isinstance(g, Mapping)
    ]
    if any(f and "nvfp4" in str(f) for f in formats):
        return "nvfp4"
    return quant.get("quant_method", "unknown")
