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

from rl.core.algo import _k3


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


def save_violation(run_dir: Path, step: int, samples: list, trainer_logp: list, metrics: dict) -> Path:
    """A step over the KL budget, as evidence: `kl_violations/step_N.npz` holds every response token's ids and
    both log-probs, flat, with each sample's offset into them (`np.load` without pickle), and
    `step_N.json` the step's `rollout_corr/*` metrics, the tokens with the largest gaps and the samples
    with the largest k3 (each with its index in the batch, group, length, finish reason and adapter
    version). Only the tokens the policy sampled count (a multi-turn episode's environment tokens are
    kept in the arrays, masked). Both files are written to a temporary name and renamed. Returns the
    JSON's path."""
    out = Path(run_dir) / VIOLATIONS_DIR
    out.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(s.response_ids) for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rollout = np.concatenate([np.asarray(s.response_logprobs, np.float32) for s in samples])
    trainer = np.concatenate(
        [np.asarray(lp, np.float32)[: len(s.response_ids)] for lp, s in zip(trainer_logp, samples)]
    )
    sampled = np.concatenate([s.generated() for s in samples])
    arrays = {
        "offsets": offsets,
        "response_ids": np.concatenate([np.asarray(s.response_ids, np.int64) for s in samples]),
        "rollout_logp": rollout,
        "trainer_logp": trainer,
        "sampled": sampled,
        "prompt_lens": np.array([len(s.prompt_ids) for s in samples], dtype=np.int64),
        "groups": np.array([s.group for s in samples], dtype=np.int64),
        "adapter_versions": np.array([s.adapter_version for s in samples], dtype=np.int64),
    }
    stem = f"step_{step:06d}"
    tmp = out / f".{stem}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, out / f"{stem}.npz")

    d = trainer.astype(np.float64) - rollout.astype(np.float64)  # log(p_trainer / p_rollout) a token
    k3 = np.where(sampled, _k3(torch.from_numpy(d)).numpy(), 0.0)  # as rollout_corr/k3_kl counts it
    sample_of = np.repeat(np.arange(len(samples)), lengths)

    def where(i: int) -> dict:
        b = int(sample_of[i])
        s = samples[b]
        return {
            "sample": b,
            "group": int(s.group),
            "position": int(i - offsets[b]),
            "response_len": int(lengths[b]),
            "finish_reason": s.finish_reason,
            "adapter_version": int(s.adapter_version),
        }

    gaps = np.where(sampled, np.abs(d), -1.0)
    top = np.argsort(-gaps, kind="stable")[: min(TOP_TOKENS, int(sampled.sum()))]
    tokens = [
        {
            **where(int(i)),
            "token_id": int(arrays["response_ids"][i]),
            "rollout_logp": float(rollout[i]),
            "trainer_logp": float(trainer[i]),
            "gap": float(d[i]),
            "k3": float(k3[i]),
        }
        for i in top
    ]
    per_sample = np.add.reduceat(k3, offsets[:-1]) if len(k3) else np.zeros(0)
    counted = np.add.reduceat(sampled.astype(np.int64), offsets[:-1]) if len(k3) else np.zeros(0)
    mean_k3 = np.where(counted > 0, per_sample / np.maximum(counted, 1), 0.0)
    worst = np.argsort(-mean_k3, kind="stable")[:TOP_SAMPLES]
    summary = {
        "step": step,
        "metrics": {k: v for k, v in metrics.items() if k.startswith("rollout_corr/")},
        "samples": len(samples),
        "tokens": int(sampled.sum()),
        "largest_gaps": tokens,
        "largest_sample_k3": [
            {
                "sample": int(b),
                "group": int(samples[b].group),
                "response_len": int(lengths[b]),
                "finish_reason": samples[b].finish_reason,
                "k3_mean": float(mean_k3[b]),
                "share_of_step_k3": float(per_sample[b] / k3.sum()) if k3.sum() > 0 else 0.0,
            }
            for b in worst
        ],
        "arrays": f"{stem}.npz",
    }
    path = out / f"{stem}.json"
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, path)
    return path
