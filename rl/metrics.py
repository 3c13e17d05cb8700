"""Step metrics: `metrics.jsonl` in the run directory (the record), TensorBoard, W&B, and the console.

One `MetricsLogger.log(step, metrics)` call per step writes to every sink. The JSONL file is appended and
flushed line by line so that a killed run keeps every finished step; on resume, lines of steps after the
checkpoint are dropped first so that the file never holds a step twice.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Shown in the console table, in this order, when present.
CONSOLE_KEYS = (
    "reward/mean",
    "acc/mean",
    "response_length/mean",
    "rollout_corr/k3_kl",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "r3/replayed_fraction",
    "perf/step_s",
)


def watched(metrics: dict[str, float]) -> dict[str, float]:
    """The few figures the progress line shows: reward, held-out mean@k (on eval steps), k3 KL, step time."""
    out = {}
    if "reward/mean" in metrics:
        out["reward"] = metrics["reward/mean"]
    for k, v in metrics.items():
        if k.startswith("val-core/") and "/acc/mean@" in k:
            out[k.rsplit("/", 1)[-1]] = v  # mean@8
    if "rollout_corr/k3_kl" in metrics:
        out["k3"] = metrics["rollout_corr/k3_kl"]
    if "perf/step_s" in metrics:
        out["s/step"] = metrics["perf/step_s"]
    return out


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Every step record of a run, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(v):
    """JSON has no NaN/inf: write them as strings so a reader sees them instead of a parse error."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int = 0,
        console_every: int = 1,
        tensorboard: bool = True,
        wandb_project: str = "",
        wandb_entity: str = "",
        run_name: str = "",
        config: dict | None = None,
        console: Console | None = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.console_every = console_every
        self.console = console or Console()
        self._truncate_after(start_step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)
        self._wandb = None
        if wandb_project:
            import wandb  # optional: only when configured

            # W&B ids allow letters, digits, '-', '_' and '.': sweep run names hold '/', '=' and ','.
            run_id = re.sub(r"[^\w.-]", "_", run_name) or None
            self._wandb = wandb.init(
                project=wandb_project,
                entity=wandb_entity or None,
                name=run_name,
                config=config,
                resume="allow",
                id=run_id,
            )
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=False,
        )
        self._watched: dict[str, float] = {}  # the progress line's figures, the newest of each
        self._task = self._progress.add_task(
            run_name or "train", total=total_steps, completed=start_step, status=""
        )
        self._progress.start()

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [r for r in read_metrics(self.path.parent) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        self._watched.update(watched(numeric))
        status = "  ".join(f"{k} {v:.3g}" for k, v in self._watched.items())
        self._progress.update(self._task, completed=step, status=status)
        if step % self.console_every == 0:
            self.console.print(self.line(step, numeric), highlight=False, soft_wrap=True)

    def event(self, text: str) -> None:
        """A one-line notice (eval results, checkpoints, warnings) above the progress bar."""
        self.console.print(text)

    @staticmethod
    def line(step: int, metrics: dict[str, float]) -> str:
        """`step 12 | reward/mean 0.31 | acc/mean 0.62 | ...`: the console keys, then the eval results."""
        keys = [k for k in CONSOLE_KEYS if k in metrics] + sorted(
            k for k in metrics if k.startswith("val-core/")
        )
        return f"step {step} | " + " | ".join(f"{k.removeprefix('val-core/')} {metrics[k]:.4g}" for k in keys)

    def close(self) -> None:
        self._progress.stop()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
