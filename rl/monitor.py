"""The KL budget: `rollout_corr/k3_kl` of every step against `monitor.k3_kl_max` and a trend limit.

k3 KL between the trainer's and the rollout's log-probs of the same tokens measures how far training is
from on-policy (numerics, quantization, routing). A single step over the budget, or a steady climb (the
mean of the last `window` steps over that of the first `window`), is reported; the driver stops the run
on it when `monitor.stop_on_violation` is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
