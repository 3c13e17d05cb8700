"""Qwen3-MoE, the reference family: transformers and vLLM have its code. Here: its router's replay (R3),
a copy of Qwen3-30B-A3B's config.json for the planner, and make-tiny's MoE model (`--arch qwen3_moe`, the
CPU demo's)."""

from __future__ import annotations

from rl.models.family import BuiltinModel, Family, PlannerFacts, Router, TinyModel

# Qwen/Qwen3-30B-A3B's config.json (the keys the planner reads), for planning without a download.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "use_sliding_window": False,
    "sliding_window": None,
}

FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    routers=(
        Router(
            cls="transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter",
            adapter="rl.models.qwen3_moe.router:replay",
        ),
    ),
    planner=PlannerFacts(
        builtin=(
            BuiltinModel(
                name="Qwen3-30B-A3B",
                match="qwen3-30b-a3b",
                source="built-in copy of Qwen/Qwen3-30B-A3B's config.json",
                config=QWEN3_30B_A3B,
            ),
        )
    ),
    tiny=TinyModel(
        arch="qwen3_moe",
        config="transformers:Qwen3MoeConfig",
        kwargs={
            "intermediate_size": 384,
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
    ),
)
