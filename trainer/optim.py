"""AdamW on the LoRA parameters and the learning-rate schedule (linear warm-up, then constant or cosine),
from the `trainer:` section (trainer/config.py) and the schedule's length in optimizer steps."""

from __future__ import annotations

import math

import torch

from trainer.config import TrainerConfig


def lr_factor(step: int, trainer: TrainerConfig, optimizer_steps: int) -> float:
    """Multiplier of trainer.lr for optimizer step `step` (0-based). Warm-up rises linearly and reaches 1 at
    step warmup_steps - 1 (no wasted step at lr 0); cosine then falls to min_lr_ratio at optimizer_steps."""
    if step < trainer.warmup_steps:
        return (step + 1) / trainer.warmup_steps
    if trainer.lr_schedule == "constant":
        return 1.0
    span = max(1, optimizer_steps - trainer.warmup_steps)
    progress = min(1.0, (step - trainer.warmup_steps) / span)
    return trainer.min_lr_ratio + (1 - trainer.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(params: list[torch.nn.Parameter], trainer: TrainerConfig, optimizer_steps: int):
    if not params:
        raise ValueError("optimizer: no trainable parameters (is the adapter attached?)")
    opt = torch.optim.AdamW(
        params, lr=trainer.lr, betas=tuple(trainer.betas), eps=trainer.eps, weight_decay=trainer.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, trainer, optimizer_steps))
    return opt, sched
