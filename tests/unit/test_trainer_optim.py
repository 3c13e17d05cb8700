"""trainer.optim: the learning-rate schedule, value by value."""

import math

import pytest
import torch

from trainer.config import TrainerConfig
from trainer.optim import lr_factor, make_optimizer


def test_warmup_then_constant():
    cfg = TrainerConfig(warmup_steps=4, lr_schedule="constant")
    assert [lr_factor(s, cfg, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_cosine_to_min_ratio():
    cfg = TrainerConfig(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(1, cfg, 12) == 1.0
    assert lr_factor(2, cfg, 12) == pytest.approx(1.0)
    assert lr_factor(7, cfg, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(12, cfg, 12) == pytest.approx(0.1) and lr_factor(50, cfg, 12) == pytest.approx(0.1)


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt, sched = make_optimizer([p], TrainerConfig(lr=0.1, warmup_steps=2), 100)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.1])
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_optimizer([], TrainerConfig(), 100)
