"""bench.long_prompts' account of non-finite log-probs (its engine needs NVFP4 + MoE LoRA: the H200 only)."""

from __future__ import annotations

import numpy as np

from bench.long_prompts import first_nonfinite, prefill_row, random_prompts


def test_first_nonfinite_counts_nan_and_inf_and_finds_the_first():
    v = np.array([-0.1, -2.0, np.nan, -np.inf, np.nan, -0.3])
    assert first_nonfinite(v) == {"n": 6, "nan": 2, "inf": 1, "first": 2}
    assert first_nonfinite(np.zeros(3) - 1)["first"] is None


def test_prefill_row_places_the_first_bad_token_in_the_sequence():
    # entry i scores token i + 1; sequence 0 (prompt 4 tokens) breaks at token 3 (a prompt token),
    # sequence 1 (prompt 2) at token 5 (a response token), sequence 2 is finite
    a = np.array([-1.0, -1.0, np.nan, np.nan, np.nan])
    b = np.array([-1.0, -1.0, -1.0, -1.0, np.inf])
    c = np.full(5, -1.0)
    row = prefill_row([a, b, c], [4, 2, 3])
    assert row["positions"] == 15 and row["nan"] == 3 and row["inf"] == 1
    assert row["sequences_bad"] == 2
    assert row["first_bad_position_min"] == 3 and row["first_bad_position_median"] == 4.0
    assert row["first_bad_in_response"] == 1


def test_random_prompts_have_the_length_asked_and_stay_in_the_vocabulary():
    ps = random_prompts(3, 128, 1000, seed=1)
    assert [len(p) for p in ps] == [128] * 3
    assert min(min(p) for p in ps) >= 10 and max(max(p) for p in ps) < 999
    assert ps == random_prompts(3, 128, 1000, seed=1) and ps != random_prompts(3, 128, 1000, seed=2)
