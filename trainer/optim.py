"""AdamW on the LoRA parameters and the learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch

from trainer.spec import OptimSpec


def lr_factor(step: int, spec: OptimSpec) -> float:
    """Multiplier of spec.lr for optimizer step `step` (0-based). Warm-up rises linearly and reaches 1 at
    step warmup_steps - 1 (no wasted step at lr 0); cosine then falls to min_lr_ratio at total_steps."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return 1.0
    span = max(1, spec.total_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(params: list[torch.nn.Parameter], spec: OptimSpec):
    if not params:
        raise ValueError("optimizer: no trainable parameters (is the adapter attached?)")
    opt = torch.optim.AdamW(
        params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, spec))
    return opt, sched
