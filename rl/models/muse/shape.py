"""What the planner (rl/plan.py) knows of Muse Spark Open: the published model as built-in facts, and the
keys of a Muse config.json that no other family has. Plain Python: the planner imports no torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LONGEST_CONTEXT = 1_048_576


def config_fields(c: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelShape fields of a Muse config.json that the common keys do not give: the latent width the
    experts work at, and the outputs of the attention head gate (one a head, or one a channel)."""
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    gate = {"headwise": heads, "elementwise": heads * head_dim}.get(c.get("head_gate"), 0)
    return {"latent": c.get("moe_latent_size") or 0, "head_gate": gate}


def _published() -> dict[str, Any]:
    """Muse Spark Open from the design doc. Its weight totals are given; head counts, routing top-k, vocab
    and the longest context are not: the values below are assumptions that agree with the totals, the same
    as the defaults of configuration_muse.py (tests/unit/test_plan.py keeps the two in step)."""
    hidden, layers, attention = 8192, 62, 13.5e9
    heads, kv_heads, head_dim, vocab = 96, 8, 128, 201_088
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o + k, v
    return dict(
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        num_experts=256,
        top_k=8,
        expert_inter=4096,
        latent=4096,
        head_gate=heads,
        window=2048,
        window_layers=46,
        max_context=LONGEST_CONTEXT,
        params={"experts": 799e9, "attention": attention, "latent": 4.2e9, "embeddings": 3.3e9},
        assumptions=[
            f"{heads} query heads, {kv_heads} KV heads, head_dim {head_dim}: q/k/v/o come to "
            f"{layers * per_layer / 1e9:.2f}B, matching attention {attention / 1e9}B",
            "expert intermediate width 4096 (799B / (62 layers x 256 experts x 3 x 4096 x 4096) = 1.00)",
            "top-8 routing",
            f"vocab {vocab:,} (3.3B embedding + output parameters ~ 2 x 8192 x vocab)",
            f"longest context {LONGEST_CONTEXT:,} tokens",
        ],
    )


PUBLISHED = _published()
