"""rl.core.algo: hand-computed cases for every formula, hypothesis properties, and split invariance."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.core import algo

T = torch.tensor


def approx(x, **kw):
    return pytest.approx(x, rel=1e-5, abs=1e-6, **kw)


# --- advantages ------------------------------------------------------------------------------------

REWARDS = T([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 1.0])
GROUPS = [0, 0, 0, 0, 1, 2, 2]  # group 1 is a lone sample


def test_grpo_advantage_is_r_minus_mean_over_unbiased_std():
    # group 0: mean .5, std sqrt(1/3); group 2: mean 2, std sqrt(2); lone sample -> 0
    a, b = 0.5 / math.sqrt(1 / 3), 1 / math.sqrt(2)
    assert algo.compute_advantages(REWARDS, GROUPS, "grpo").tolist() == approx([a, -a, -a, a, 0, b, -b])


def test_drgrpo_advantage_has_no_std():
    assert algo.compute_advantages(REWARDS, GROUPS, "drgrpo").tolist() == approx(
        [0.5, -0.5, -0.5, 0.5, 0, 1, -1]
    )


def test_rloo_advantage_is_r_minus_mean_of_others():
    adv = algo.compute_advantages(REWARDS, torch.tensor(GROUPS), "rloo")
    assert adv.tolist() == approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0, 2, -2])


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="'gae'"):
        algo.compute_advantages(REWARDS, GROUPS, "gae")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.floats(-5, 5, allow_nan=False, width=32)), min_size=1, max_size=24
    ),
    st.sampled_from(["grpo", "drgrpo", "rloo"]),
)
def test_advantages_of_a_group_sum_to_zero(samples, estimator):
    groups = [g for g, _ in samples]
    adv = algo.compute_advantages(T([r for _, r in samples]), groups, estimator)
    for g in set(groups):
        members = adv[T(groups) == g]
        assert float(members.sum()) == pytest.approx(0.0, abs=1e-4 * len(members))


# --- dynamic sampling and overlong penalty ----------------------------------------------------------


def test_filter_groups_drops_groups_with_equal_rewards():
    keep, metrics = algo.filter_groups(T([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 7.0]), [0, 0, 1, 1, 2, 2, 3])
    assert keep.tolist() == [False, False, True, True, False, False, False]
    assert metrics == {"batch/kept_groups": 1.0}


def test_overlong_penalty_is_linear_in_the_buffer():
    pen = algo.overlong_penalty([10, 16, 17, 18, 20, 25], max_response_length=20, buffer=4)
    assert pen.tolist() == approx([0, 0, -0.25, -0.5, -1, -1])
    assert algo.overlong_penalty([19], 20, 4, penalty_factor=0.5).tolist() == approx([-0.375])
    with pytest.raises(ValueError, match="buffer"):
        algo.overlong_penalty([1], 20, 0)


# --- KL estimators and mismatch metrics -------------------------------------------------------------


def test_kl_estimators_k1_k2_k3():
    logp, ref = T([[-1.0]]), T([[-2.0]])
    assert algo.kl_estimate(logp, ref, "k1").item() == approx(1.0)
    assert algo.kl_estimate(logp, ref, "k2").item() == approx(0.5)
    assert algo.kl_estimate(logp, ref, "k3").item() == approx(math.exp(-1) + 1 - 1)
    with pytest.raises(ValueError, match="k4"):
        algo.kl_estimate(logp, ref, "k4")


def test_k3_kl_is_masked_mean_of_exp_d_minus_d_minus_1():
    trainer, rollout = T([[0.5, -0.5, 3.0]]), torch.zeros(1, 3)
    expected = (math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 2
    assert algo.k3_kl(trainer, rollout, T([[1, 1, 0]])).item() == approx(expected)


@settings(max_examples=300, deadline=None)
@given(st.floats(-50, 0, width=32), st.floats(-50, 0, width=32))
def test_k3_is_nonnegative_and_zero_only_when_equal(a, b):
    k3 = algo.k3_kl(T([[a]]), T([[b]]), torch.ones(1, 1)).item()
    assert k3 >= 0
    assert (k3 == 0) == (a == b)


def test_mismatch_metrics_hand_case():
    trainer = T([[-1.0, -2.0], [-1.0, 0.0]])
    rollout = T([[-1.5, -1.5], [-2.0, 0.0]])
    m = algo.rollout_mismatch_metrics(trainer, rollout, T([[1, 1], [1, 0]]))
    k3 = [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5, math.e - 2]  # d = .5, -.5, 1
    assert m["rollout_corr/k3_kl"] == approx(sum(k3) / 3)
    assert m["rollout_corr/k3_kl_max"] == approx(k3[2])
    # per sequence: mean rollout - mean trainer = 0 and -1
    assert m["rollout_corr/log_ppl_diff"] == approx(-0.5)
    assert m["rollout_corr/log_ppl_abs_diff_max"] == approx(1.0)
    # |d| = .5, .5, 1; linear interpolation like torch.quantile
    assert m["rollout_corr/abs_logp_diff_p50"] == approx(0.5)
    assert m["rollout_corr/abs_logp_diff_p90"] == approx(0.9)
    assert m["rollout_corr/abs_logp_diff_p99"] == approx(0.99)
    assert m["rollout_corr/abs_logp_diff_max"] == approx(1.0)


def test_mismatch_quantiles_match_torch_quantile():
    g = torch.Generator().manual_seed(0)
    trainer, rollout = -torch.rand(4, 50, generator=g), -torch.rand(4, 50, generator=g)
    mask = torch.rand(4, 50, generator=g) > 0.3
    m = algo.rollout_mismatch_metrics(trainer, rollout, mask)
    d = (trainer.double() - rollout.double())[mask].abs()
    for q in (50, 90, 99):
        assert m[f"rollout_corr/abs_logp_diff_p{q}"] == approx(float(torch.quantile(d, q / 100)))


# --- off-policy correction --------------------------------------------------------------------------

MASK2 = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_rollout_correction_is_off_by_default():
    old = torch.log(T([[0.5, 1.0, 3.0], [1.0, 1.0, 1.0]]))
    weights, loss_mask, metrics = algo.rollout_correction(old, torch.zeros(2, 3), MASK2)
    assert weights is None and metrics == {}
    assert torch.equal(loss_mask, MASK2)


def test_tis_caps_the_token_ratio():
    old = torch.log(T([[0.5, 1.0, 3.0], [2.5, 1.0, 9.0]]))  # rho, rollout log-probs are 0
    weights, _, metrics = algo.rollout_correction(old, torch.zeros(2, 3), MASK2, tis_cap=2.0)
    assert weights.flatten().tolist() == approx([0.5, 1.0, 2.0, 2.0, 1.0, 0.0])
    assert metrics["rollout_corr/tis_capped_frac"] == approx(2 / 5)


def test_mis_token_bounds_mask_tokens():
    old = torch.log(T([[0.4, 1.0, 2.5], [1.0, 1.9, 1.0]]))
    _, loss_mask, metrics = algo.rollout_correction(
        old, torch.zeros(2, 3), MASK2, mis_token_bounds=(0.5, 2.0)
    )
    assert loss_mask.tolist() == [[0, 1, 0], [1, 1, 0]]
    assert metrics["rollout_corr/mis_masked_frac"] == approx(2 / 5)


def test_mis_geometric_mean_masks_whole_sequences():
    # geometric means: sqrt(4 * .25 * 1) ^ (1/3) = 1 -> kept; sqrt(3 * 3) = 3 -> dropped
    old = torch.log(T([[4.0, 0.25, 1.0], [3.0, 3.0, 100.0]]))
    _, loss_mask, metrics = algo.rollout_correction(old, torch.zeros(2, 3), MASK2, mis_seq_bounds=(0.5, 2.0))
    assert loss_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert metrics["rollout_corr/mis_seq_masked_frac"] == approx(0.5)
    assert metrics["rollout_corr/mis_masked_frac"] == approx(2 / 5)


# --- policy loss -------------------------------------------------------------------------------------


def _one_row(ratios, adv, **kw):
    lp = torch.log(T([ratios], dtype=torch.float64))
    return algo.policy_loss(
        lp, torch.zeros_like(lp), T([adv], dtype=torch.float64), torch.ones_like(lp), **kw
    )


def test_vanilla_loss_clip_higher_and_dual_clip():
    # A>0,r=1.5: clip to 1.28 | A>0,r=.5: unclipped | A<0,r=.5: clip to .8 | A<0,r=5: dual clip at 3 | r=1
    loss, m = _one_row([1.5, 0.5, 0.5, 5.0, 1.0], [1, 1, -1, -1, -1])
    assert loss.item() == approx((-1.28 - 0.5 + 0.8 + 3.0 + 1.0) / 5)
    assert m["actor/pg_loss"] == approx(loss.item())
    assert m["actor/pg_clipfrac"] == approx(2 / 5)
    assert m["actor/pg_clipfrac_lower"] == approx(1 / 5)
    assert m["actor/ppo_kl"] == approx(-sum(math.log(r) for r in [1.5, 0.5, 0.5, 5.0, 1.0]) / 5)
    assert _one_row([1.5, 0.5, 0.5, 5.0, 1.0], [1, 1, -1, -1, -1], loss_mode="ppo")[0].item() == approx(
        loss.item()
    )


def test_gspo_uses_the_sequence_ratio():
    # seq 0: log ratios .1, .3 -> s = e^.2 (inside the clip); seq 1: log ratio .5 -> e^.5, clipped to 1.28
    lp = T([[0.1, 0.3], [0.5, 0.0]], dtype=torch.float64)
    mask = T([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, m = algo.policy_loss(lp, torch.zeros_like(lp), T([1.0, 1.0]), mask, loss_mode="gspo")
    assert loss.item() == approx((-2 * math.exp(0.2) - 1.28) / 3)
    assert m["actor/pg_clipfrac"] == approx(1 / 3)


def test_aggregation_modes_hand_case():
    # ratio 1, so a token's loss is -A; seq 0: one token, A=2; seq 1: three tokens, A=-1
    lp = torch.zeros(2, 3, dtype=torch.float64)
    mask, adv = T([[1.0, 0, 0], [1, 1, 1]]), T([2.0, -1.0])
    cases = {
        "token-mean": (-2 + 3) / 4,
        "seq-mean-token-mean": (-2 + 1) / 2,
        "seq-mean-token-sum-norm": 0.125,
    }
    for mode, expected in cases.items():
        loss, _ = algo.policy_loss(lp, lp, adv, mask, loss_agg_mode=mode, loss_scale_factor=4)
        assert loss.item() == approx(expected), mode


def test_is_weights_kl_term_and_entropy_metric():
    lp, mask = torch.zeros(1, 3, dtype=torch.float64), T([[1.0, 1.0, 0.0]])
    ref = T([[-0.2, 0.4, 5.0]], dtype=torch.float64)  # k1 = logp - ref = .2, -.4
    loss, m = algo.policy_loss(
        lp,
        lp,
        T([1.0]),
        mask,
        is_weights=T([[0.5, 2.0, 7.0]], dtype=torch.float64),
        ref_log_prob=ref,
        kl_coef=0.1,
        kl_type="k1",
        entropy=T([[1.0, 2.0, 99.0]]),
    )
    assert m["actor/pg_loss"] == approx(-1.25)
    assert m["actor/kl_loss"] == approx(-0.1)
    assert loss.item() == approx(-1.25 - 0.01)
    assert m["actor/entropy"] == approx(1.5)


def test_entropy_bonus_is_subtracted_aggregated_and_carries_gradient():
    lp, mask = torch.zeros(1, 3, dtype=torch.float64), T([[1.0, 1.0, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 99.0]], dtype=torch.float64, requires_grad=True)
    loss, m = algo.policy_loss(lp, lp, T([1.0]), mask, entropy=ent, entropy_coeff=0.1)
    assert m["actor/entropy_loss"] == approx(1.5) and m["actor/entropy"] == approx(1.5)
    assert loss.item() == approx(m["actor/pg_loss"] - 0.1 * 1.5)
    loss.backward()
    assert ent.grad[0].tolist() == approx([-0.05, -0.05, 0.0])  # -coeff / tokens on the mask, 0 off it
    with pytest.raises(ValueError, match="entropy is required when entropy_coeff != 0"):
        algo.policy_loss(lp, lp, T([1.0]), mask, entropy_coeff=0.1)


def test_one_mis_bound_alone_masks_its_side_only():
    old = torch.log(T([[0.4, 1.0, 2.5], [1.0, 1.9, 1.0]]))
    _, low_only, _ = algo.rollout_correction(old, torch.zeros(2, 3), MASK2, mis_token_bounds=(0.5, math.inf))
    assert low_only.tolist() == [[0, 1, 1], [1, 1, 0]]
    _, high_only, _ = algo.rollout_correction(old, torch.zeros(2, 3), MASK2, mis_token_bounds=(0.0, 2.0))
    assert high_only.tolist() == [[1, 1, 0], [1, 1, 0]]


@settings(max_examples=200, deadline=None)
@given(
    log_ratio=st.floats(-5, 5),
    adv=st.one_of(st.floats(0.01, 10), st.floats(-10, -0.01)),
    low=st.floats(0, 0.5),
    high=st.floats(0, 0.5),
    c=st.floats(1.5, 5),
)
def test_clipped_ratio_stays_in_bounds(log_ratio, adv, low, high, c):
    r = math.exp(log_ratio)
    loss, _ = _one_row([r], [adv], clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    effective = -loss.item() / adv  # the ratio the loss actually uses
    if adv > 0:
        assert effective == pytest.approx(min(r, 1 + high), rel=1e-9)
        assert effective <= 1 + high + 1e-12
    else:
        assert 1 - low - 1e-12 <= effective <= c + 1e-12
        assert effective == pytest.approx(min(max(r, 1 - low), c), rel=1e-9)
    gspo, _ = _one_row([r], [adv], loss_mode="gspo", clip_ratio_low=low, clip_ratio_high=high)
    gspo_ratio = -gspo.item() / adv
    assert gspo_ratio <= 1 + high + 1e-12 if adv > 0 else gspo_ratio >= 1 - low - 1e-12


def test_algo_config_defaults_are_dapo_and_match_the_functions():
    cfg = algo.AlgoConfig()
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert (cfg.loss_agg_mode, cfg.adv_estimator, cfg.loss_mode) == ("token-mean", "grpo", "vanilla")
    assert (cfg.tis_cap, cfg.mis_token_bounds, cfg.mis_seq_bounds, cfg.kl_coef) == (None, None, None, 0.0)
    # the same numbers as policy_loss's own defaults
    loss_default, _ = _one_row([1.5, 5.0], [1, -1])
    loss_cfg, _ = _one_row(
        [1.5, 5.0],
        [1, -1],
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
    )
    assert loss_default.item() == loss_cfg.item() == approx((-1.28 + 3.0) / 2)


# --- split invariance --------------------------------------------------------------------------------

B, TT = 8, 7


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, TT + 1, (B,), generator=g)
    mask = (torch.arange(TT) < lengths[:, None]).double()
    mask[3] = 0  # a sequence MIS dropped entirely
    old = -3 * torch.rand(B, TT, generator=g, dtype=torch.float64)
    return {
        "log_prob": (old + 0.3 * torch.randn(B, TT, generator=g, dtype=torch.float64)).requires_grad_(),
        "old_log_prob": old,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
        "response_mask": mask,
        "is_weights": 0.5 + torch.rand(B, TT, generator=g, dtype=torch.float64),
        "ref_log_prob": old + 0.1 * torch.randn(B, TT, generator=g, dtype=torch.float64),
    }


def _micro(batch, rows):
    """Rows of the batch, padded only to their own longest response (as dynamic batching does)."""
    idx = torch.tensor(rows)
    width = max(1, int(batch["response_mask"][idx].sum(-1).max()))
    return {k: v[idx] if v.dim() == 1 else v[idx, :width] for k, v in batch.items()}


# 1 rank x 4 micro-batches; 2 ranks (interleaved, like a distributed sampler) x 2; uneven micro-batches
SPLITS = {
    "1x4": [[[0, 1], [2, 3], [4, 5], [6, 7]]],
    "2x2": [[[0, 2], [4, 6]], [[1, 3], [5, 7]]],
    "uneven": [[[5], [0, 1, 2]], [[3, 4, 6, 7]]],
}


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
@pytest.mark.parametrize("agg", algo.LOSS_AGG_MODES)
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_split_over_ranks_and_micro_batches_sums_to_the_unsplit_loss(loss_mode, agg, split):
    batch = _batch(seed=1)
    kw = dict(loss_mode=loss_mode, loss_agg_mode=agg, loss_scale_factor=TT, kl_coef=0.05)
    full, _ = algo.policy_loss(**batch, **kw)
    (full_grad,) = torch.autograd.grad(full, batch["log_prob"])

    ranks = SPLITS[split]
    counts = [algo.loss_normalisers(_micro(batch, rows)["response_mask"]) for rank in ranks for rows in rank]
    tokens, seqs = (sum(c) for c in zip(*counts))  # the all-reduce (SUM) of the counts
    assert (tokens, seqs) == algo.loss_normalisers(batch["response_mask"])
    total = 0
    for rank in ranks:
        for rows in rank:  # gradient accumulation: a sum over micro-batches, and over ranks
            loss, _ = algo.policy_loss(
                **_micro(batch, rows), **kw, global_num_tokens=tokens, global_num_seqs=seqs
            )
            total = total + loss
    (split_grad,) = torch.autograd.grad(total, batch["log_prob"])
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-12)


def test_dp_size_makes_the_rank_mean_equal_the_unsplit_loss():
    batch = _batch(seed=2)
    full, _ = algo.policy_loss(**batch)
    tokens, _ = algo.loss_normalisers(batch["response_mask"])
    ranks = [
        algo.policy_loss(**_micro(batch, rows), global_num_tokens=tokens, dp_size=2)[0]
        for rows in ([0, 2, 4, 6], [1, 3, 5, 7])
    ]
    assert ((ranks[0] + ranks[1]) / 2).item() == pytest.approx(full.item(), rel=1e-12)


def test_split_needs_the_global_normaliser_of_its_mode():
    batch = _batch(seed=3)
    with pytest.raises(ValueError, match="global_num_seqs"):
        algo.policy_loss(**batch, loss_agg_mode="seq-mean-token-mean", global_num_tokens=10)
    with pytest.raises(ValueError, match="normaliser must be > 0"):
        algo.policy_loss(**batch, global_num_tokens=0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        algo.policy_loss(**batch, loss_agg_mode="seq-mean-token-sum-norm")


def test_all_masked_micro_batch_contributes_zero_under_a_global_count():
    batch = _micro(_batch(seed=4), [3])  # the all-masked sequence
    loss, _ = algo.policy_loss(**batch, global_num_tokens=10)
    assert loss.item() == 0.0


# --- entropy -----------------------------------------------------------------------------------------


def test_entropy_hand_cases():
    uniform = torch.zeros(2, 3, 16)
    assert algo.token_entropy(uniform).flatten().tolist() == approx([math.log(16)] * 6)
    peaked = T([[[0.0, -1e4, -1e4]]])
    assert algo.token_entropy(peaked).item() == approx(0.0)
    two = T([[[0.0, 0.0, -1e4]]])
    assert algo.token_entropy(two).item() == approx(math.log(2))


def _reference_entropy(logits):
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_is_chunked_and_matches_the_direct_formula(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 40, generator=g)).bfloat16().requires_grad_()
    seen = []
    original = algo._chunk_entropy

    def spy(chunk):
        seen.append((chunk.shape[0], chunk.dtype))
        return original(chunk)

    monkeypatch.setattr(algo, "_chunk_entropy", spy)
    ent = algo.token_entropy(logits, chunk_size=4)  # 15 rows -> 4 + 4 + 4 + 3
    assert ent.shape == (3, 5) and ent.dtype == torch.float32
    assert seen == [(4, torch.bfloat16)] * 3 + [(3, torch.bfloat16)]
    torch.testing.assert_close(ent.double(), _reference_entropy(logits.detach()), rtol=1e-5, atol=1e-5)

    # backward recomputes each chunk (checkpoint) and gives the direct formula's gradient
    w = torch.randn(3, 5, generator=g)
    (grad,) = torch.autograd.grad((ent * w).sum(), logits)
    assert len(seen) == 8
    x = logits.detach().float().requires_grad_()
    (ref_grad,) = torch.autograd.grad((_reference_entropy(x).float() * w).sum(), x)
    torch.testing.assert_close(grad.float(), ref_grad, rtol=2e-2, atol=2e-3)


# --- bad input ---------------------------------------------------------------------------------------


def test_shape_mismatch_names_the_tensor():
    lp, mask = torch.zeros(2, 3), torch.ones(2, 4)
    with pytest.raises(ValueError, match="log_prob has shape"):
        algo.policy_loss(lp, torch.zeros(2, 4), T([1.0, 1.0]), mask)
    with pytest.raises(ValueError, match="advantages has shape"):
        algo.policy_loss(torch.zeros(2, 4), torch.zeros(2, 4), T([1.0, 1.0, 1.0]), mask)
    with pytest.raises(ValueError, match="logp_rollout has shape"):
        algo.k3_kl(torch.zeros(2, 4), torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match="group_ids"):
        algo.compute_advantages(T([1.0, 0.0]), [0, 0, 1])


def test_empty_or_non_binary_mask_is_an_error():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="response_mask is empty"):
        algo.policy_loss(z, z, T([1.0, 1.0]), z)
    with pytest.raises(ValueError, match="mask is empty"):
        algo.k3_kl(z, z, z)
    with pytest.raises(ValueError, match="response_mask is empty"):
        algo.rollout_correction(z, z, z, tis_cap=2.0)
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        algo.policy_loss(z, z, T([1.0, 1.0]), torch.full((2, 3), 0.5))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_log_probs_name_the_tensor(bad):
    ok, mask = torch.zeros(2, 3), torch.ones(2, 3)
    broken = ok.clone()
    broken[1, 2] = bad
    with pytest.raises(ValueError, match="^log_prob has 1 NaN/inf"):
        algo.policy_loss(broken, ok, T([1.0, 1.0]), mask)
    with pytest.raises(ValueError, match="^old_log_prob has 1 NaN/inf"):
        algo.policy_loss(ok, broken, T([1.0, 1.0]), mask)
    with pytest.raises(ValueError, match="^logp_trainer"):
        algo.rollout_mismatch_metrics(broken, ok, mask)
    with pytest.raises(ValueError, match="^rollout_log_prob"):
        algo.rollout_correction(ok, broken, mask, tis_cap=2.0)
    with pytest.raises(ValueError, match="^is_weights"):
        algo.policy_loss(ok, ok, T([1.0, 1.0]), mask, is_weights=broken)
    with pytest.raises(ValueError, match="^rewards"):
        algo.compute_advantages(T([1.0, bad]), [0, 0])


def test_nonfinite_values_off_the_mask_do_not_reach_loss_or_gradient():
    mask = T([[1.0, 1.0, 0.0]])
    clean = T([[-0.5, -1.0, 0.0]], dtype=torch.float64).requires_grad_()
    dirty = T([[-0.5, -1.0, math.nan]], dtype=torch.float64).requires_grad_()
    old = T([[-0.6, -0.9, math.inf]], dtype=torch.float64)
    adv = T([[1.0, -1.0, math.nan]], dtype=torch.float64)
    ref_loss, _ = algo.policy_loss(clean, old.nan_to_num(posinf=0.0), adv.nan_to_num(), mask)
    loss, _ = algo.policy_loss(dirty, old, adv, mask)
    assert loss.item() == approx(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    assert torch.isfinite(dirty.grad).all()
    torch.testing.assert_close(dirty.grad, clean.grad)
