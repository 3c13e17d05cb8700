"""The GRPO loop end to end on CPU: real vLLM-CPU rollouts, 2 FSDP2 ranks over gloo, on a real Ray cluster
of two nodes (conftest's two_node_cluster: the workers cannot all fit on one).

Three steps of the tiny SFT'd Qwen3-MoE (merged sync, R3 on: the routing by reference, never through the
driver) with a killed rollout worker, the same run again, and a resume; the dense model's run and SIGTERM are in test_train_runs.py (two files, so that
`make test` runs them side by side).
"""

from __future__ import annotations

import math

import pytest

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
    "perf/driver_bytes",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "batch/kept_groups",
    "reward/errors",
    "train/skipped_steps",
]


# Metrics that must agree exactly between two runs of one seed (sampled tokens and their rewards), and those
# that may differ by float reduction order only (within 1e-6).
EXACT = ["reward/mean", "acc/mean", "response_length/mean", "response_length/clip_ratio", "batch/kept_groups"]
CLOSE = ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "rollout_corr/k3_kl"]
# Mini-batches of 2 prompts: 2 optimizer steps a batch of 4, so the resume covers a batch of several.
THREE_STEPS = ["trainer.total_steps=3", "trainer.checkpoint_every=2", "trainer.mini_batch_size=2"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, two_node_cluster, tiny_moe_sft_path, small_demo_config):
    """Three steps with the rollout worker killed after step 1 (the pool recreates it and replays the weights),
    on the two nodes of `two_node_cluster`: (config, summary, run directory, restarts, the samples' routing as the
    driver received it: by value / by reference counts, the nodes the workers ran on)."""
    import ray

    from rl.driver import Run

    tmp = tmp_path_factory.mktemp("e2e")
    cfg = small_demo_config(tmp, "killed", THREE_STEPS)
    run = Run(cfg)
    try:
        actors = run.rollout.workers + run.trainer.workers
        nodes = ray.get([a.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()) for a in actors])
        original = run.train_step

        def step_then_kill(step):
            metrics = original(step)
            if step == 1:
                ray.kill(run.rollout.workers[0])
            return metrics

        run.train_step = step_then_kill
        generate, routing = run.rollout.generate, {"value": 0, "ref": 0}

        def generate_and_count(requests, sampling):
            samples = generate(requests, sampling)
            routing["value"] += sum(s.routed_experts is not None for s in samples)
            routing["ref"] += sum(s.routing_ref is not None for s in samples)
            return samples

        run.rollout.generate = generate_and_count
        summary = run.train()
        restarts = run.rollout.restarts
    finally:
        run.close()
    return cfg, summary, tmp / "killed", restarts, routing, nodes


def test_three_steps_report_every_metric_through_a_killed_rollout_worker(killed_run, two_node_cluster):
    _, summary, run_dir, restarts, routing, nodes = killed_run
    assert restarts == 1
    assert set(nodes) == two_node_cluster  # the rollout engine and the two trainer ranks spanned both nodes
    # R3's routing went from the rollout worker to the trainer ranks by reference, never to the driver
    assert routing["value"] == 0 and routing["ref"] >= 3 * 4 * 4
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        missing = [k for k in STEP_KEYS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        bad = {k: r[k] for k in STEP_KEYS if not (isinstance(r[k], int | float) and math.isfinite(r[k]))}
        assert not bad, f"step {r['step']} has non-finite {bad}"
        assert r["adapter/version"] == r["step"]  # the rollout workers got a new policy every step
        assert r["rollout_corr/k3_kl"] < 1e-9  # the fp32 floor: the same policy on both sides
        assert r["actor/optimizer_steps"] == 2
    assert any(k.startswith("val-core/synthetic/arith/acc/mean@4") for k in records[2])
    assert (run_dir / "eval" / "step_2.jsonl").exists()
    assert (run_dir / "report" / "report.md").exists() and summary["steps"] == 3


def test_same_seed_same_run(killed_run, tmp_path, small_demo_config):
    """A second run of the same seed and config, this one without a killed worker, is the same run: sampled
    tokens and rewards bitwise, losses within 1e-6, the evaluation's responses and scores bitwise. So the
    seeds are the run's alone, and a recreated rollout worker changes nothing."""
    from rl.driver import train

    first_dir = killed_run[2]
    train(small_demo_config(tmp_path, "again", THREE_STEPS))
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

    cfg, run_dir = killed_run[0], killed_run[2]
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
