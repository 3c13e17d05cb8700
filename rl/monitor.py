"""The KL budget: `rollout_corr/k3_kl` of every step against `monitor.k3_kl_max` and a trend limit.

k3 KL between the trainer's and the rollout's log-probs of the same tokens measures how far training is
from on-policy (numerics, quantization, routing). A single step over the budget, or a steady climb (the
mean of the last `window` steps over that of the first `window`), is reported; the driver stops the run
on it when `monitor.stop_on_violation` is set, and writes the evidence of a step over the budget
(`save_violation`: where in the batch the two sides part) for the first `monitor.save_violations` of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rl.core.algo import _k3, k3_sequence_sums
from rl.core.batch import Sample


class StopRun(RuntimeError):
    """The run cannot go on (KL budget with stop_on_violation, repeated non-finite losses); says why."""


@dataclass
class KLMonitor:
    k3_kl_max: float = 0.0  # 0 = no per-step check
    trend_max: float = 0.0  # 0 = no trend check
    window: int = 10
    history: list[float] = field(default_factory=list)
    violations: int = 0

    def check(self, k3_kl: float) -> str | None:
        """Record a step's KL; a message when it breaks the budget, else None."""
        self.history.append(float(k3_kl))
        problems = []
        if self.k3_kl_max > 0 and not k3_kl <= self.k3_kl_max:  # NaN counts as a violation
            problems.append(f"rollout_corr/k3_kl {k3_kl:.3g} > monitor.k3_kl_max {self.k3_kl_max:g}")
        ratio = self.trend()
        if self.trend_max > 0 and ratio is not None and ratio > self.trend_max:
            problems.append(
                f"k3 KL trend x{ratio:.2f} over the last {self.window} steps > "
                f"monitor.k3_kl_trend_max {self.trend_max:g}"
            )
        if problems:
            self.violations += 1
            return "; ".join(problems)
        return None

    def trend(self) -> float | None:
        """Mean of the last `window` steps over the mean of the first `window` (None until 2 windows exist)."""
        if len(self.history) < 2 * self.window:
            return None
        first = sum(self.history[: self.window]) / self.window
        last = sum(self.history[-self.window :]) / self.window
        return last / first if first > 0 else float("inf") if last > 0 else 1.0

    def state_dict(self) -> dict:
        return {"history": self.history, "violations": self.violations}

    def load_state_dict(self, state: dict) -> None:
        self.history, self.violations = list(state["history"]), int(state["violations"])


VIOLATIONS_DIR = "kl_violations"
TOP_TOKENS = 20  # the tokens with the largest |trainer - rollout| log-prob gap a summary lists
TOP_SAMPLES = 10  # likewise the samples by their own k3


def mismatch_tensors(
    trainer_logp: list[np.ndarray], samples: list[Sample]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's and the rollout's response log-probs, padded to [B, T] float64, and their mask (the
    tokens the policy sampled)."""
    width = max(len(s.response_ids) for s in samples)
    t = torch.zeros(len(samples), width, dtype=torch.float64)
    r = torch.zeros_like(t)
    mask = torch.zeros_like(t)
    for i, (lp, s) in enumerate(zip(trainer_logp, samples)):
        n = len(s.response_ids)
        t[i, :n] = torch.from_numpy(np.array(lp, dtype=np.float64))
        r[i, :n] = torch.from_numpy(np.array(s.response_logprobs, dtype=np.float64))
        mask[i, :n] = torch.from_numpy(s.generated())
    return t, r, mask


def concentration(d: torch.Tensor, mask: torch.Tensor) -> dict:
    """How a step's k3 is spread over its tokens, from the gaps d [B, T] (log p_trainer - log p_rollout) at
    `mask`: the shares of the step's k3 sum in its 10 and its 1 % largest-k3 tokens, and the median |d|. A few
    tokens carrying most of it (the GPU demo on one H100: 1 % of the tokens, 83-91 %) point at contexts the two
    stacks compute apart; a share spread evenly, rather at the whole policy moving apart (a stale adapter)."""
    d = d[mask.bool()].double()
    if d.numel() == 0:
        return {"top_10_tokens_share": 0.0, "top_1pct_tokens_share": 0.0, "abs_gap_median": 0.0}
    ordered = torch.sort(_k3(d), descending=True).values
    whole = float(ordered.sum())

    def share(n: int) -> float:
        return float(ordered[:n].sum()) / whole if whole > 0 else 0.0

    return {
        "top_10_tokens_share": share(10),
        "top_1pct_tokens_share": share(max(1, d.numel() // 100)),
        "abs_gap_median": float(d.abs().median()),
    }


def save_violation(
    run_dir: Path, step: int, samples: list[Sample], trainer_logp: list[np.ndarray], metrics: dict
) -> Path:
    """A step over the KL budget, as evidence: `kl_violations/step_N.npz` holds every response token's ids and
    both log-probs, flat, with each sample's offset into them (`np.load` without pickle), and
    `step_N.json` the step's `rollout_corr/*` metrics, how its k3 is spread (`concentration`), the tokens
    with the largest gaps and the samples with the largest k3 (each with its index in the batch, group,
    length, finish reason and adapter version). Only the tokens the policy sampled count (a multi-turn
    episode's environment tokens are kept in the arrays, masked). Both files are written to a temporary name
    and renamed. Returns the JSON's path."""
    out = Path(run_dir) / VIOLATIONS_DIR
    out.mkdir(parents=True, exist_ok=True)
    lengths = [len(s.response_ids) for s in samples]
    arrays = {
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "response_ids": np.concatenate([np.asarray(s.response_ids, np.int64) for s in samples]),
        "rollout_logp": np.concatenate([np.asarray(s.response_logprobs, np.float32) for s in samples]),
        "trainer_logp": np.concatenate(
            [np.asarray(lp, np.float32)[: len(s.response_ids)] for lp, s in zip(trainer_logp, samples)]
        ),
        "sampled": np.concatenate([s.generated() for s in samples]),
        "prompt_lens": np.array([len(s.prompt_ids) for s in samples], dtype=np.int64),
        "groups": np.array([s.group for s in samples], dtype=np.int64),
        "adapter_versions": np.array([s.adapter_version for s in samples], dtype=np.int64),
    }
    stem = f"step_{step:06d}"
    tmp = out / f".{stem}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, out / f"{stem}.npz")

    t, r, mask = mismatch_tensors(trainer_logp, samples)
    d = t - r  # log(p_trainer / p_rollout) a token
    sums, counts = k3_sequence_sums(t, r, mask)  # each sample's k3, as rollout_corr/k3_kl counts it
    total = float(sums.sum())

    def sample(b: int) -> dict:
        s = samples[b]
        return {
            "sample": b,
            "group": int(s.group),
            "response_len": lengths[b],
            "finish_reason": s.finish_reason,
            "adapter_version": int(s.adapter_version),
        }

    gaps = torch.where(mask.bool(), d.abs(), -1.0).flatten()
    top = torch.argsort(gaps, descending=True, stable=True)[: min(TOP_TOKENS, int(counts.sum()))]
    tokens = []
    for i in top.tolist():
        b, pos = divmod(i, d.shape[1])
        tokens.append(
            {
                **sample(b),
                "position": pos,
                "token_id": int(samples[b].response_ids[pos]),
                "rollout_logp": float(r[b, pos]),
                "trainer_logp": float(t[b, pos]),
                "gap": float(d[b, pos]),
                "k3": float(_k3(d[b, pos])),
            }
        )
    mean = sums / counts.clamp(min=1)
    worst = torch.argsort(mean, descending=True, stable=True)[:TOP_SAMPLES]
    summary = {
        "step": step,
        "metrics": {k: v for k, v in metrics.items() if k.startswith("rollout_corr/")},
        "samples": len(samples),
        "tokens": int(counts.sum()),
        "concentration": concentration(d, mask),
        "largest_gaps": tokens,
        "largest_sample_k3": [
            {
                **sample(b),
                "k3_mean": float(mean[b]),
                "share_of_step_k3": float(sums[b]) / total if total > 0 else 0.0,
            }
            for b in worst.tolist()
        ],
        "arrays": f"{stem}.npz",
    }
    path = out / f"{stem}.json"
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, path)
    return path
