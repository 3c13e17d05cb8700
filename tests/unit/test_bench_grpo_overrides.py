"""bench.grpo's recipe overrides: `--grpo-base-format` picks the trainer's checkpoint and its base format."""

from __future__ import annotations

import pytest

from bench import grpo
from bench.run_all import parse_args
from rl.config import load_config

MODEL = {"dq": "/models/m/dq", "nvfp4": "/models/m/nvfp4", "spec": {"max_operand": 99}}


@pytest.mark.parametrize("fmt,path", [("nvfp4", "/models/m/nvfp4"), ("bf16", "/models/m/dq")])
def test_grpo_base_format_reaches_the_config(tmp_path, fmt, path):
    args = parse_args(["--grpo-base-format", fmt])
    cfg = load_config("demo_cpu", grpo.config_overrides(MODEL, "muse", args, tmp_path / "run"))
    assert cfg.trainer.base_format == fmt
    assert cfg.model.path == path
    assert cfg.model.rollout_path == "/models/m/nvfp4"


def test_grpo_base_format_defaults_to_the_bf16_twin():
    assert parse_args([]).grpo_base_format == "bf16"
