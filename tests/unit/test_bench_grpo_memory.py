"""bench.grpo's per-phase device memory: the phases of a synchronous step laid out from its times, each
phase's peak from the sampled memory, and the plan's figures beside the measured ones."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.grpo import DeviceMemory, GiB, add_phase_memory, phase_windows, plan_comparison

ROOT = Path(__file__).resolve().parents[2]


def test_phases_follow_one_another_in_a_synchronous_step():
    row = {"step": 2, "step_s": 10.0, "rollout_s": 4.0, "logprob_s": 1.0, "train_s": 3.0, "staleness": None}
    w = phase_windows(100.0, row)
    assert w == {
        "rollout": (100.0, 104.0),
        "logprob": (104.0, 105.0),
        "train": (105.0, 108.0),
        "sync": (108.0, 110.0),
        "step": (100.0, 110.0),
    }
    # an asynchronous step overlaps its phases: the whole step only
    assert phase_windows(100.0, {**row, "staleness": 1}) == {"step": (100.0, 110.0)}


def test_each_phase_gets_its_peak_and_the_summary_the_largest():
    rows = [
        {"step": 1, "step_s": 4.0, "rollout_s": 1.0, "logprob_s": 0.0, "train_s": 2.0},
        {"step": 2, "step_s": 4.0, "rollout_s": 1.0, "logprob_s": 0.0, "train_s": 2.0},
        {"step": "median"},
    ]
    starts = {1: 0.0, 2: 10.0}
    samples = [(0.5, 70 * GiB), (1.5, 60 * GiB), (2.5, 66 * GiB), (3.5, 20 * GiB)]  # step 1
    samples += [(10.5, 72 * GiB), (11.5, 50 * GiB), (13.5, 21 * GiB)]  # step 2
    add_phase_memory(rows, samples, starts)
    one, two, summary = rows
    assert (one["mem_rollout_gib"], one["mem_train_gib"], one["mem_sync_gib"]) == (70, 66, 20)
    assert one["mem_logprob_gib"] is None  # a phase of no length has no sample
    assert (two["mem_rollout_gib"], two["mem_train_gib"], two["mem_step_gib"]) == (72, 50, 72)
    assert (summary["mem_rollout_gib"], summary["mem_train_gib"], summary["mem_sync_gib"]) == (72, 66, 21)


def test_sampler_reads_on_its_thread_until_stopped():
    values = iter(range(1, 10_000))
    with DeviceMemory(lambda: next(values) * GiB, every_s=0.01) as memory:
        time.sleep(0.1)
    n = len(memory.samples)
    assert n >= 3 and [b for _, b in memory.samples] == [i * GiB for i in range(1, n + 1)]
    time.sleep(0.05)
    assert len(memory.samples) == n  # stopped
    assert all(a < b for (a, _), (b, _) in zip(memory.samples, memory.samples[1:]))


def test_plan_figures_and_the_measured_over_them():
    from rl import plan as P
    from rl.config import load_config

    cfg = load_config(ROOT / "recipes" / "qwen3_30b_a3b_1gpu.yaml")
    p = P.make_plan(cfg)
    summary = {"mem_rollout_gib": 70.0, "mem_logprob_gib": None, "mem_train_gib": 60.0}
    plan_comparison(cfg, summary)
    assert summary["plan_rollout_gib"] == pytest.approx((p.t_resident + p.r_budget) / GiB)
    assert summary["plan_train_gib"] == pytest.approx((p.t_peak + P.RUNTIME_BYTES) / GiB)
    assert summary["rollout_vs_plan"] == pytest.approx(70.0 / summary["plan_rollout_gib"])
    assert summary["train_vs_plan"] == pytest.approx(60.0 / summary["plan_train_gib"])
