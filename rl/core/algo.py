"""The math of one GRPO/DAPO step, on top of verl 0.9.1's `core_algos` (pure torch; no Ray or vLLM here,
although `import verl` itself pulls in ray).

Read top to bottom: advantages -> dynamic sampling and overlong penalty -> KL and trainer/rollout mismatch
-> off-policy correction (TIS/MIS) -> policy loss -> entropy. Shapes: B samples, T response tokens
(padded), V vocabulary. A response mask is [B, T], float or bool, 1 on the tokens that count.

How a trainer makes the loss independent of how a batch is split over ranks and micro-batches:
  1. For one optimizer step, count the loss units over everything that step sees, on every rank:
     `num_tokens, num_seqs = loss_normalisers(loss_mask)`, then all-reduce both with SUM.
  2. For each micro-batch: `loss, m = policy_loss(..., global_num_tokens=num_tokens,
     global_num_seqs=num_seqs)` and `loss.backward()`. Gradients accumulate, i.e. they are SUMMED over
     micro-batches: never divide by the number of micro-batches. `actor/pg_loss` of a micro-batch is
     its share; the step's loss is the sum of the shares.
  3. Across ranks the gradient reduction must be a SUM (FSDP2: `model.set_gradient_divide_factor(1.0)`).
     If it averages (FSDP2's default), pass `dp_size=world_size` instead: each share is scaled up by it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import verl.utils.torch_functional as verl_F
from torch.utils.checkpoint import checkpoint
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.workers.config import ActorConfig

from rl.core import user_code

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3", "k1+", "k3+")  # verl's names; "+" = k2 gradient with a k1/k3 value
# Log-ratios are clamped to +-20 before exp, as verl does (SAFETY_BOUND in rollout_corr_helper).
_LOG_RATIO_BOUND = 20.0


@dataclass
class AlgoConfig:
    """The algorithm's knobs in one place; the functions below take them as explicit arguments."""

    adv_estimator: str = "grpo"  # "grpo" | "drgrpo" | "rloo"
    adv_eps: float = 1e-6
    loss_mode: str = "vanilla"  # "vanilla" (= "ppo") | "gspo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28  # DAPO clip-higher
    clip_ratio_c: float = 3.0  # dual clip, for negative advantages
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm only: use the max response length
    kl_coef: float = 0.0  # KL to the reference policy in the loss; 0 = off (DAPO)
    kl_type: str = "k3"
    entropy_coeff: float = 0.0  # entropy bonus: the loss minus entropy_coeff * aggregated entropy; 0 = off
    tis_cap: float | None = None  # truncated IS, cap C; None = off
    mis_token_bounds: tuple[float, float] | None = None  # masked IS, ratio bounds per token
    mis_seq_bounds: tuple[float, float] | None = None  # masked IS, bounds on the geometric-mean ratio

    @property
    def corrects_rollout(self) -> bool:
        """TIS or MIS on: the loss reweights by trainer/rollout ratios of the old log-probs."""
        bounds = (self.tis_cap, self.mis_token_bounds, self.mis_seq_bounds)
        return any(b is not None for b in bounds)


# ----------------------------------------------------------------------------------------------------
# Input checks: a bad tensor is a ValueError that names it, never a NaN loss later.


def _check_mask(name: str, mask: torch.Tensor, allow_empty: bool = False) -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError(f"{name} must hold only 0 and 1")
    if not allow_empty and not mask.any():
        raise ValueError(f"{name} is empty: no token to average over")
    return mask.bool()


def _check_values(name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Checks x against the (bool) mask's shape and finiteness under it; returns x with 0 off the mask, so
    padding garbage cannot reach the loss or its gradient (0 * NaN is NaN in backward too)."""
    if x.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(mask.shape)} (the mask's)")
    bad = ~torch.isfinite(x) & mask
    if bad.any():
        raise ValueError(f"{name} has {int(bad.sum())} NaN/inf values on masked-in tokens")
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _check_rewards(rewards: torch.Tensor, group_ids) -> tuple[torch.Tensor, np.ndarray]:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards has NaN/inf values")
    ids = group_ids.cpu().numpy() if isinstance(group_ids, torch.Tensor) else np.asarray(group_ids)
    if ids.shape != (rewards.shape[0],):
        raise ValueError(f"group_ids has shape {ids.shape}, expected ({rewards.shape[0]},) like rewards")
    return rewards, ids


# ----------------------------------------------------------------------------------------------------
# Advantages: one scalar per sample from its group's rewards. verl's estimators take token-level rewards
# [B, T]; an outcome reward is the same as a [B, 1] token reward, so we pass that and squeeze.

AdvEstimator = Callable[[torch.Tensor, np.ndarray, float], torch.Tensor]
ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    """Registers fn(rewards [B], group_ids np [B], eps) -> advantages [B] under a config name."""

    def deco(fn: AdvEstimator) -> AdvEstimator:
        ADV_ESTIMATORS[name] = fn
        return fn

    return deco


def _outcome_advantage(verl_fn, rewards: torch.Tensor, ids: np.ndarray, **kwargs) -> torch.Tensor:
    col = rewards.reshape(-1, 1)
    adv, _ = verl_fn(col, torch.ones_like(col), ids, **kwargs)
    adv = adv.squeeze(-1)
    # verl gives a group of one mean 0 (GRPO: and std 1), i.e. its raw reward as advantage. A lone sample
    # has no baseline to compare with, so here it carries no signal.
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    lone = torch.as_tensor(counts[inverse] == 1, device=adv.device)
    return torch.where(lone, torch.zeros_like(adv), adv)


@register_adv_estimator("grpo")
def _grpo(rewards: torch.Tensor, ids: np.ndarray, eps: float) -> torch.Tensor:
    # (r - mean) / (std + eps), std with Bessel's correction (torch.std), as verl has it.
    # verl's loop version, not its vectorised one: that one takes std from sum-of-squares, which leaves a
    # rounding-sized std (and so noise-sized advantages) in a group whose rewards are all equal.
    return _outcome_advantage(core_algos.compute_grpo_outcome_advantage, rewards, ids, epsilon=eps)


@register_adv_estimator("drgrpo")
def _drgrpo(rewards: torch.Tensor, ids: np.ndarray, eps: float) -> torch.Tensor:
    # Dr.GRPO: r - mean, no std normalisation.
    return _outcome_advantage(
        core_algos.compute_grpo_outcome_advantage, rewards, ids, epsilon=eps, norm_adv_by_std_in_grpo=False
    )


@register_adv_estimator("rloo")
def _rloo(rewards: torch.Tensor, ids: np.ndarray, eps: float) -> torch.Tensor:
    # RLOO: r_i - mean of the other samples of the group.
    return _outcome_advantage(core_algos.compute_rloo_outcome_advantage, rewards, ids, epsilon=eps)


@functools.cache
def _user_function(key: str, value: str):
    return user_code.resolve(key, value)


def adv_estimator_fn(estimator: str) -> AdvEstimator:
    """A registered estimator, or one named by import path (`file.py:name`, `module:name`) with verl's
    `compute_*_advantage` signature, called as verl's trainer calls it: keyword arguments
    `token_level_rewards` [B, 1] (an outcome reward is one token's), `response_mask` [B, 1], `index` (the
    group ids, numpy) and `config` (None); it returns (advantages, returns) or advantages, [B, 1] or [B]."""
    if estimator in ADV_ESTIMATORS:
        return ADV_ESTIMATORS[estimator]
    if user_code.is_import_path(estimator):
        return functools.partial(
            _user_advantage, _user_function("algorithm.adv_estimator", estimator), estimator
        )
    raise ValueError(
        f"unknown advantage estimator {estimator!r}; known: {sorted(ADV_ESTIMATORS)}, or an import path "
        "(`file.py:name`, `module:name`)"
    )


def _user_advantage(fn, name: str, rewards: torch.Tensor, ids: np.ndarray, eps: float) -> torch.Tensor:
    col = rewards.reshape(-1, 1)
    out = fn(token_level_rewards=col, response_mask=torch.ones_like(col), index=ids, config=None)
    adv = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(adv, torch.Tensor):
        raise TypeError(
            f"algorithm.adv_estimator: {name} returned {type(adv).__name__}; expected a tensor [B, 1] or "
            "[B] (or a tuple (advantages, returns))"
        )
    if adv.shape not in ((len(rewards), 1), (len(rewards),)):
        raise ValueError(
            f"algorithm.adv_estimator: {name} returned shape {tuple(adv.shape)}; expected "
            f"[{len(rewards)}, 1] or [{len(rewards)}]"
        )
    adv = adv.reshape(-1).to(rewards)
    if not torch.isfinite(adv).all():
        raise ValueError(f"algorithm.adv_estimator: {name} returned NaN/inf advantages")
    return adv


def compute_advantages(rewards, group_ids, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """rewards [B] float, group_ids [B] (tensor, list or array; one id per prompt) -> advantages [B],
    on the rewards' device. `estimator`: a registered name or an import path (`adv_estimator_fn`)."""
    fn = adv_estimator_fn(estimator)
    rewards, ids = _check_rewards(rewards, group_ids)
    # verl's estimators loop over samples in Python: on CPU that is ~0.1 s for 8k samples, on a GPU it
    # would be thousands of tiny kernels. float64: in float32 the mean of equal rewards can miss them by
    # an ulp, and that ulp divided by (std ~ 0) + eps gives a group of equal rewards advantages of ~0.2.
    return fn(rewards.cpu().double(), ids, eps).to(rewards)


# ----------------------------------------------------------------------------------------------------
# Batch shaping (DAPO). verl does both inside its trainer and reward manager, not as functions.


def filter_groups(rewards, group_ids) -> tuple[torch.Tensor, dict[str, float]]:
    """Dynamic sampling: keep only groups whose rewards are not all equal (the others have zero advantage
    and only dilute the batch). rewards [B], group_ids [B] -> (keep [B] bool, {"batch/kept_groups": n})."""
    rewards, ids = _check_rewards(rewards, group_ids)
    _, inverse = np.unique(ids, return_inverse=True)
    g = torch.as_tensor(inverse, device=rewards.device)
    n = int(g.max()) + 1 if g.numel() else 0
    hi = rewards.new_full((n,), -math.inf).scatter_reduce(0, g, rewards, "amax")
    lo = rewards.new_full((n,), math.inf).scatter_reduce(0, g, rewards, "amin")
    kept = hi > lo
    return kept[g], {"batch/kept_groups": float(kept.sum())}


def overlong_penalty(response_lengths, max_response_length: int, buffer: int, penalty_factor: float = 1.0):
    """DAPO soft overlong punishment, added to the reward: 0 up to max - buffer, then linear down to
    -penalty_factor at max_response_length (and beyond). response_lengths [B] int -> penalty [B] float."""
    if not 0 < buffer <= max_response_length:
        raise ValueError(f"buffer must be in (0, max_response_length={max_response_length}], got {buffer}")
    lengths = torch.as_tensor(response_lengths).float()
    exceed = lengths - (max_response_length - buffer)
    return (-exceed / buffer).clamp(-1.0, 0.0) * penalty_factor


# ----------------------------------------------------------------------------------------------------
# KL estimators and the trainer/rollout mismatch.


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimates, samples from pi; [B, T] -> [B, T]. verl's `kl_penalty`:
    k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1 (clamped to +-10)."""
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; known: {KL_TYPES}")
    return core_algos.kl_penalty(log_prob, ref_log_prob, kl_type)


def _k3(d: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 in float64, exact to rounding: > 0 for every d != 0 and 0 at d == 0. Hand-written
    because verl's k3 computes it in the input dtype (float32 cancellation gives 0 or < 0 near d = 0) and
    clamps the result at 10, which would hide the outliers a mismatch monitor exists to show."""
    d = d.double().clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    series = d * d * (0.5 + d * (1 / 6 + d * (1 / 24 + d * (1 / 120 + d / 720))))  # Taylor, |d| < 1e-2
    return torch.where(d.abs() < 1e-2, series, torch.expm1(d) - d)


def k3_kl(logp_trainer: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over tokens of exp(d) - d - 1, d = logp_trainer - logp_rollout (an estimate of
    KL(rollout || trainer) from the rollout's samples). [B, T] each -> 0-dim float64 tensor."""
    m = _check_mask("mask", mask)
    lt = _check_values("logp_trainer", logp_trainer, m).double()
    return _k3(lt - _check_values("logp_rollout", logp_rollout, m))[m].mean()


def _quantiles(x: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    # torch.quantile refuses inputs over 2^24 elements (a step has more tokens); same linear rule by hand.
    s = x.sort().values
    out = []
    for q in qs:
        pos = q * (s.numel() - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, s.numel() - 1)
        out.append(float(s[lo] + (s[hi] - s[lo]) * (pos - lo)))
    return out


def rollout_mismatch_metrics(
    logp_trainer: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs (before any update) are from the rollout's. [B, T] each.
    log_ppl_diff is verl's: mean over sequences of (mean logp_rollout - mean logp_trainer)."""
    m = _check_mask("mask", mask)
    lt = _check_values("logp_trainer", logp_trainer, m).double()
    lr = _check_values("logp_rollout", logp_rollout, m).double()
    d = lt - lr
    k3 = _k3(d)[m]
    n = m.sum(-1)
    has = n > 0
    log_ppl_diff = ((lr.sum(-1) - lt.sum(-1)) / n.clamp(min=1))[has]
    p50, p90, p99 = _quantiles(d[m].abs(), (0.5, 0.9, 0.99))
    return {
        "rollout_corr/k3_kl": float(k3.mean()),
        "rollout_corr/k3_kl_max": float(k3.max()),
        "rollout_corr/log_ppl_diff": float(log_ppl_diff.mean()),
        "rollout_corr/log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "rollout_corr/log_ppl_abs_diff_max": float(log_ppl_diff.abs().max()),
        "rollout_corr/abs_logp_diff_max": float(d[m].abs().max()),
        "rollout_corr/abs_logp_diff_p50": p50,
        "rollout_corr/abs_logp_diff_p90": p90,
        "rollout_corr/abs_logp_diff_p99": p99,
    }


def k3_sequence_sums(
    logp_trainer: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] each -> (each sequence's sum of k3 over its tokens, its token count), [B] each, float64:
    `rollout_corr/k3_kl` is sums.sum() / counts.sum(). Two scorings of the same sequences (R3 on and off)
    compare pairwise through these (bench/kl.py keeps both in its rows)."""
    m = _check_mask("mask", mask)
    d = _check_values("logp_trainer", logp_trainer, m).double() - _check_values(
        "logp_rollout", logp_rollout, m
    )
    return torch.where(m, _k3(d), 0.0).sum(-1), m.sum(-1).double()


# ----------------------------------------------------------------------------------------------------
# Off-policy correction from rollout log-probs: rho = pi_old / pi_rollout, fixed before the update
# (pi_old = the trainer's log-probs with the rollout's adapter), so a trainer computes it once per step.


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    tis_cap: float | None = None,
    mis_token_bounds: tuple[float, float] | None = None,
    mis_seq_bounds: tuple[float, float] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """[B, T] each -> (is_weights [B, T] or None, loss_mask [B, T] float, metrics). All off by default.

    TIS: weight min(rho, C) per token (verl's `compute_rollout_correction_weights`, token level).
    MIS: drop tokens with rho outside mis_token_bounds, and whole sequences whose geometric-mean rho,
    exp(mean log rho), is outside mis_seq_bounds (both judged on all response tokens). Dropped tokens
    leave the loss and its normaliser: use the returned loss_mask for `loss_normalisers` and
    `policy_loss`. For MIS with rho weights on the kept tokens, also set tis_cap >= the upper bound.
    """
    m = _check_mask("response_mask", response_mask)
    log_rho = _check_values("old_log_prob", old_log_prob, m) - _check_values(
        "rollout_log_prob", rollout_log_prob, m
    )
    mf = m.to(log_rho.dtype)
    metrics: dict[str, float] = {}
    weights = None
    if tis_cap is not None:
        if tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
        weights, is_metrics = compute_rollout_correction_weights(log_rho, mf, "token", float(tis_cap))
        metrics["rollout_corr/tis_capped_frac"] = is_metrics["rollout_is_ratio_fraction_high"]
        metrics["rollout_corr/tis_weight_mean"] = is_metrics["rollout_is_mean"]
    # Hand-written: verl's rejection mask states k1 bounds on -log rho, a threshold string, and adds a
    # dozen metrics; the mask in the direct ratio is three lines.
    keep = m.clone()
    log_rho = log_rho.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    if mis_token_bounds is not None:
        lo, hi = _log_bounds("mis_token_bounds", mis_token_bounds)
        keep &= (log_rho >= lo) & (log_rho <= hi)
    if mis_seq_bounds is not None:
        lo, hi = _log_bounds("mis_seq_bounds", mis_seq_bounds)
        n = m.sum(-1)
        geo = (log_rho * mf).sum(-1) / n.clamp(min=1)
        seq_keep = (geo >= lo) & (geo <= hi)
        keep &= seq_keep.unsqueeze(-1)
        metrics["rollout_corr/mis_seq_masked_frac"] = float((~seq_keep & (n > 0)).sum() / (n > 0).sum())
    if mis_token_bounds is not None or mis_seq_bounds is not None:
        metrics["rollout_corr/mis_masked_frac"] = float((m & ~keep).sum() / m.sum())
    return weights, keep.to(old_log_prob.dtype), metrics


def _log_bounds(name: str, bounds: tuple[float, float]) -> tuple[float, float]:
    """Bounds on the ratio -> on its log; low 0 and high inf are open ends."""
    lo, hi = bounds
    if not 0 <= lo <= 1 <= hi:
        raise ValueError(f"{name} must satisfy 0 <= low <= 1 <= high, got {bounds}")
    return (math.log(lo) if lo > 0 else -math.inf), math.log(hi)


# ----------------------------------------------------------------------------------------------------
# Policy loss. The per-token math is verl's (vanilla: PPO clip with clip_ratio_low/high and dual clip
# clip_ratio_c; gspo: sequence-level ratio exp(mean log ratio)); aggregation is verl's `agg_loss`, which
# takes the global token/sequence counts that make micro-batch shares add up to the unsplit loss.

POLICY_LOSSES: dict[str, core_algos.PolicyLossFn] = {}


def register_policy_loss(name: str):
    """Registers a function with verl's PolicyLossFn signature under a config name."""

    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn

    return deco


for _name, _verl_name in (("vanilla", "vanilla"), ("ppo", "vanilla"), ("gspo", "gspo")):
    register_policy_loss(_name)(core_algos.get_policy_loss_fn(_verl_name))


def policy_loss_fn(loss_mode: str) -> core_algos.PolicyLossFn:
    """A registered loss, or one named by import path (`file.py:name`, `module:name`) with verl's
    PolicyLossFn signature: `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
    rollout_is_weights) -> (loss, metrics)`, config being verl's ActorConfig (`config.global_batch_info`
    for `core_algos.agg_loss`). Resolved in the process that calls it (each trainer rank)."""
    if loss_mode in POLICY_LOSSES:
        return POLICY_LOSSES[loss_mode]
    if user_code.is_import_path(loss_mode):
        return _user_function("algorithm.policy_loss", loss_mode)
    raise ValueError(
        f"unknown loss_mode {loss_mode!r}; known: {sorted(POLICY_LOSSES)}, or an import path "
        "(`file.py:name`, `module:name`)"
    )


def loss_normalisers(loss_mask: torch.Tensor) -> tuple[int, int]:
    """loss_mask [B, T] -> (tokens, sequences with at least one token), agg_loss's definitions. Sum both
    over all micro-batches and ranks of an optimizer step and pass them to `policy_loss`."""
    m = _check_mask("loss_mask", loss_mask, allow_empty=True)
    return int(m.sum()), int(m.any(-1).sum())


@dataclass
class LossInputs:
    """One micro-batch's tensors. log_prob [B, T] (with grad), old_log_prob [B, T], advantages [B] or
    [B, T], response_mask [B, T] (the loss mask from `rollout_correction` when MIS is on), is_weights
    [B, T] (TIS), ref_log_prob [B, T] (the KL term), entropy [B, T] (the `actor/entropy` metric; with
    entropy_coeff != 0 the bonus too, so it needs its gradient then)."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    is_weights: torch.Tensor | None = None
    ref_log_prob: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass
class LossOutputs:
    loss: torch.Tensor  # scalar: this micro-batch's share of the optimizer step's loss
    metrics: dict[str, float]


@dataclass(frozen=True)
class LossConfig:
    """The loss of one optimizer step: the algorithm's knobs and the step's normalisers, checked and turned
    into verl's ActorConfig once, then used for each micro-batch.

    global_num_tokens (token-mean) / global_num_seqs (seq-mean modes): the counts over all micro-batches
    and ranks of the step (`loss_normalisers`, summed); without them each micro-batch is normalised by its
    own counts. seq-mean-token-sum-norm needs loss_scale_factor (the max response length), since verl's
    default, the padded T, changes from micro-batch to micro-batch."""

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    global_num_tokens: int | None = None
    global_num_seqs: int | None = None
    loss_scale_factor: float | None = None
    dp_size: int = 1
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coeff: float = 0.0

    @classmethod
    def of_step(cls, a: AlgoConfig, global_num_tokens: int, global_num_seqs: int) -> LossConfig:
        """The loss of an optimizer step under the algorithm `a`, normalised by the step's global counts."""
        return cls(
            loss_mode=a.loss_mode,
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
            loss_scale_factor=a.loss_scale_factor,
            kl_coef=a.kl_coef,
            kl_type=a.kl_type,
            entropy_coeff=a.entropy_coeff,
        )

    def __post_init__(self):
        policy_loss_fn(self.loss_mode)  # an unknown name, or code that cannot be had, fails here
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; known: {LOSS_AGG_MODES}")
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0 and self.clip_ratio_c > 1):
            raise ValueError(
                f"need 0 <= clip_ratio_low < 1, clip_ratio_high >= 0, clip_ratio_c > 1; got "
                f"{self.clip_ratio_low}, {self.clip_ratio_high}, {self.clip_ratio_c}"
            )
        normaliser = self.global_num_tokens if self.token_mode else self.global_num_seqs
        if self.split and normaliser is None:
            needed = "global_num_tokens" if self.token_mode else "global_num_seqs"
            raise ValueError(
                f"loss_agg_mode {self.loss_agg_mode!r} needs {needed} when the batch is split (a global count "
                "or dp_size was given)"
            )
        if normaliser is not None and normaliser <= 0:
            raise ValueError(f"global normaliser must be > 0, got {normaliser} (every token masked out?)")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError("seq-mean-token-sum-norm needs loss_scale_factor (e.g. the max response length)")
        # verl's loss functions read their knobs from an ActorConfig (gspo insists on the class); this is the
        # smallest one its validation accepts. The batch-size fields are required by it and unused here.
        actor = ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            clip_ratio=self.clip_ratio_low,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode,
            global_batch_info=self.batch_info,
        )
        object.__setattr__(self, "actor", actor)

    @property
    def token_mode(self) -> bool:
        return self.loss_agg_mode == "token-mean"

    @property
    def split(self) -> bool:
        """The batch is split over micro-batches or ranks: normalised by global counts."""
        return self.global_num_tokens is not None or self.global_num_seqs is not None or self.dp_size != 1

    @property
    def batch_info(self) -> dict:
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.global_num_tokens,
            "global_batch_size": self.global_num_seqs,
            "loss_scale_factor": self.loss_scale_factor,
        }


def compute_loss(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """Clipped policy-gradient loss of one micro-batch (+ the KL term and the entropy bonus where on)."""
    # A micro-batch may be all padding/masked when the global count carries the normalisation.
    m = _check_mask("response_mask", inputs.response_mask, allow_empty=config.split)
    log_prob = _check_values("log_prob", inputs.log_prob, m)
    old_log_prob = _check_values("old_log_prob", inputs.old_log_prob, m).detach()
    advantages = inputs.advantages
    if advantages.dim() == 1:
        if advantages.shape[0] != m.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)}, expected [B={m.shape[0]}] or [B, T]"
            )
        advantages = advantages.unsqueeze(-1).expand_as(m)
    advantages = _check_values("advantages", advantages, m).detach()
    is_weights = inputs.is_weights
    if is_weights is not None:
        is_weights = _check_values("is_weights", is_weights, m).detach()
    mask = m.to(log_prob.dtype)
    batch_info, agg = config.batch_info, config.loss_agg_mode

    out = policy_loss_fn(config.loss_mode)(
        old_log_prob, log_prob, advantages, mask, agg, config.actor, is_weights
    )
    if not (
        isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and out[0].dim() == 0
    ):
        raise TypeError(
            f"policy loss {config.loss_mode!r} returned {type(out).__name__}; expected (scalar loss tensor, "
            "metrics dict), verl's PolicyLossFn"
        )
    loss, verl_metrics = out
    metrics = {"actor/pg_loss": float(loss.detach())}
    metrics.update({k: float(v) for k, v in (verl_metrics or {}).items()})

    if config.kl_coef:
        if inputs.ref_log_prob is None:
            raise ValueError("ref_log_prob is required when kl_coef != 0")
        ref = _check_values("ref_log_prob", inputs.ref_log_prob, m).detach()
        kl_loss = core_algos.agg_loss(kl_estimate(log_prob, ref, config.kl_type), mask, agg, **batch_info)
        loss = loss + config.kl_coef * kl_loss
        metrics["actor/kl_loss"] = float(kl_loss.detach())
    if config.entropy_coeff and inputs.entropy is None:
        raise ValueError("entropy is required when entropy_coeff != 0")
    if inputs.entropy is not None:
        ent = _check_values("entropy", inputs.entropy, m)
        metrics["actor/entropy"] = float(verl_F.masked_mean(ent.detach(), mask))
        if config.entropy_coeff:
            entropy_loss = core_algos.agg_loss(ent, mask, agg, **batch_info)
            loss = loss - config.entropy_coeff * entropy_loss
            metrics["actor/entropy_loss"] = float(entropy_loss.detach())
    if not torch.isfinite(loss):
        raise ValueError(f"policy loss is {float(loss.detach())} although every input was finite")
    return LossOutputs(loss, metrics)


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_weights: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    **config,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`compute_loss` in one call, for a single micro-batch or a reference: the tensors of LossInputs and
    the keyword arguments of LossConfig. -> (scalar loss, metrics)."""
    out = compute_loss(
        LossInputs(log_prob, old_log_prob, advantages, response_mask, is_weights, ref_log_prob, entropy),
        LossConfig(**config),
    )
    return out.loss, out.metrics


# ----------------------------------------------------------------------------------------------------
# Entropy.


def _chunk_entropy(chunk: torch.Tensor) -> torch.Tensor:
    return verl_F.entropy_from_logits(chunk.float())


def token_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) per position: [..., V] (any dtype) -> [...] float32.

    Rows go through fp32 chunk_size at a time, so [tokens, V] never exists in fp32. Under autograd each
    chunk is checkpointed (recomputed in backward): verl's `entropy_from_logits_with_chunking` keeps every
    chunk's fp32 softmax alive for backward, which is the whole [tokens, V] again.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = [
        checkpoint(_chunk_entropy, c, use_reentrant=False) if grad else _chunk_entropy(c)
        for c in flat.split(chunk_size)
    ]
    return torch.cat(parts).reshape(logits.shape[:-1])
