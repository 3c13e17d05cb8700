"""trainer.optim: the learning-rate schedule, value by value."""

import math

import pytest
import torch

from trainer.optim import lr_factor, make_optimizer
from trainer.spec import OptimSpec


def test_warmup_then_constant():
    spec = OptimSpec(warmup_steps=4, schedule="constant")
    assert [lr_factor(s, spec) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_cosine_to_min_ratio():
    spec = OptimSpec(warmup_steps=2, total_steps=12, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(1, spec) == 1.0
    assert lr_factor(2, spec) == pytest.approx(1.0)
    assert lr_factor(7, spec) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(12, spec) == pytest.approx(0.1) and lr_factor(50, spec) == pytest.approx(0.1)


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt, sched = make_optimizer([p], OptimSpec(lr=0.1, warmup_steps=2))
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.1])
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_optimizer([], OptimSpec())
