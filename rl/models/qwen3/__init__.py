"""Qwen3, dense: transformers and vLLM have its code. Here: make-tiny's dense model (`--arch dense`), the
dense model of the tests (a MoE-only path must refuse it) and of the serving examples."""

from __future__ import annotations

from rl.models.family import Family, TinyModel

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    tiny=TinyModel(
        arch="dense", config="transformers:Qwen3Config", kwargs={"intermediate_size": 384, "head_dim": 32}
    ),
)
