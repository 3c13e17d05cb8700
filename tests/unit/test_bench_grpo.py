"""bench.grpo's rows from a run's metrics.jsonl: a row a step, and the median of the steps after the first."""

from __future__ import annotations

import json

import pytest

from bench.grpo import KEYS, rows_from_metrics


def test_rows_are_the_steps_and_their_median_leaves_out_the_first(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps = [
        {"step": 0, "val-core/arith/acc/mean@8": 0.5},  # an eval record at the start: no step figures
        {"step": 1, "perf/step_s": 30.0, "perf/sync_s": 9.0, "rollout_corr/k3_kl": 1e-3},
        {"step": 2, "perf/step_s": 4.0, "perf/sync_s": 1.0, "rollout_corr/k3_kl": 2e-5},
        {"step": 3, "perf/step_s": 6.0, "perf/sync_s": 1.0, "rollout_corr/k3_kl": 4e-5},
    ]
    path.write_text("".join(json.dumps(m) + "\n" for m in steps))
    rows = rows_from_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3, "median"]
    assert set(rows[0]) == {"step", *KEYS}
    median = rows[-1]
    # step 1 (compiling, warming) left out
    assert median["step_s"] == 5.0 and median["k3_kl"] == pytest.approx(3e-5)
    assert median["sync_share"] == 1.0 / 5.0
    assert median["rollout_s"] is None  # absent from every step: no figure made up


def test_budget_stops_before_a_step_that_would_end_past_it():
    from bench.grpo import next_step_fits

    assert next_step_fits(0.0, [], 10.0)  # the first step always runs
    assert next_step_fits(500.0, [], 10.0)
    assert next_step_fits(230.0, [130.0, 90.0], 400.0)  # 230 + 130 = 360
    assert not next_step_fits(300.0, [130.0, 90.0], 400.0)  # the longest step so far would end at 430
    assert next_step_fits(1e6, [1e3], 0.0)  # no budget
