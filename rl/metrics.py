"""Step metrics: `metrics.jsonl` in the run directory (the record), TensorBoard, W&B, MLflow, and the console.

One `MetricsLogger.log(step, metrics)` call per step writes to every sink, and `log_rollouts(step, rows)`
sends a few of the step's samples (the rows of `rollouts/step_<N>.jsonl`) to the trackers as a table. The
JSONL file is appended and flushed line by line so that a killed run keeps every finished step; on resume,
lines of steps after the checkpoint are dropped first so that the file never holds a step twice.

MLflow (`logging.mlflow_tracking_uri`): params are the flattened config, metrics the step metrics (names
MLflow refuses, such as `mean@8`, spelled `mean_at_8`), the rollout tables artifacts
`rollouts/step_<N>.json`. The MLflow run's id is kept in `<run>/mlflow_run_id`, so `--resume` goes on
logging into the same MLflow run; MLflow cannot delete points, so steps that were logged after the
checkpoint and before the stop show twice there (metrics.jsonl and TensorBoard drop them).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import sys
import time
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

from rl.rollout_records import clip_text

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
    """Every step record of a run, in order. A last line cut short (no newline: the process died inside
    its write) is no record and is left out; any other line that is not JSON is an error naming the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):  # after the last newline: a torn append
                break
            raise ValueError(f"{path}, line {number}: not a JSON record ({e.msg})") from None
    return records


def _finite(v):
    """JSON has no NaN/inf: write them as strings so a reader sees them instead of a parse error."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


# ----------------------------------------------------------------------------------------------------
# Optional trackers: each needs its package only when its key is set
# ----------------------------------------------------------------------------------------------------

DEFAULT_MLFLOW_EXPERIMENT = "sparkrl"
MLFLOW_RUN_ID_FILE = "mlflow_run_id"
WANDB_RUN_ID_FILE = "wandb_run_id"
# (config key, module, package to install) of each optional tracker
_TRACKERS = (
    ("logging.wandb_project", "wandb", "wandb"),
    ("logging.mlflow_tracking_uri", "mlflow", "mlflow"),
)


class TrackerMissing(ValueError):
    """A tracker is configured but its package is not installed; the message names the key and the fix."""


def _missing(key: str, module: str, package: str) -> str:
    return f"{key} is set but {module} is not installed: pip install {package} (or set {key}= to turn it off)"


def tracker_problems(logging_cfg) -> list[str]:
    """One line for each tracker that `logging_cfg` (the config's `logging` section) turns on and whose
    package is missing. Cheap (no import), so it can run before Ray starts."""
    return [
        _missing(key, module, package)
        for key, module, package in _TRACKERS
        if getattr(logging_cfg, key.split(".", 1)[1]) and importlib.util.find_spec(module) is None
    ]


def _import_tracker(key: str):
    _, module, package = next(t for t in _TRACKERS if t[0] == key)
    try:
        return __import__(module)
    except ImportError:
        raise TrackerMissing(_missing(key, module, package)) from None


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts: it allows letters, digits, `_ - . / :` and spaces, so `mean@8` is
    written `mean_at_8` and any other character `_`."""
    return re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))


# ----------------------------------------------------------------------------------------------------
# Rollout samples in the trackers
# ----------------------------------------------------------------------------------------------------

TRACKER_ROWS = 16  # samples a step sent to the trackers at most
TRACKER_TEXT_CHARS = 500  # a prompt or response cut to about this many characters there
_SHORT_TEXT_CHARS = 100  # ground truth and prediction
ROLLOUT_COLUMNS = (
    "step",
    "group",
    "index",
    "data_source",
    "reward",
    "acc",
    "pred",
    "ground_truth",
    "response_length",
    "finish_reason",
    "k3_kl",
    "adapter_version",
    "prompt",
    "response",
)


def _reward(row: dict) -> float | None:
    v = row.get("reward")
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def best_and_worst(rows: list[dict], n: int) -> list[dict]:
    """At most `n` rows: the (n + 1) // 2 of the highest reward (first among equals), then the n // 2 of the
    lowest, never one twice; all rows, best first, when there are no more than n. A row without a numeric reward
    ranks below every other."""
    order = sorted(range(len(rows)), key=lambda i: (_reward(rows[i]) is None, -(_reward(rows[i]) or 0.0), i))
    if len(order) <= n:
        return [rows[i] for i in order]
    best = order[: n - n // 2]
    worst = order[len(order) - n // 2 :]
    return [rows[i] for i in best + worst]


def tracker_rows(rows: list[dict]) -> list[dict]:
    """The rows a step sends to the trackers: `best_and_worst` TRACKER_ROWS, texts cut, the columns of
    ROLLOUT_COLUMNS in that order (a missing key is None)."""
    out = []
    for row in best_and_worst(rows, TRACKER_ROWS):
        r = {c: row.get(c) for c in ROLLOUT_COLUMNS}
        for c in ("prompt", "response"):
            r[c] = clip_text(r[c], TRACKER_TEXT_CHARS)
        for c in ("pred", "ground_truth"):
            r[c] = None if r[c] is None else clip_text(r[c], _SHORT_TEXT_CHARS)
        out.append(r)
    return out


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def _md_cell(value) -> str:
    """A value as one Markdown table cell as TensorBoard renders it: HTML and Markdown characters escaped
    (a response holds `*`, `_`, `<` and `|` often enough), line breaks as <br>."""
    if isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = "" if value is None else str(value)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text).replace("\r\n", "\n").replace("\n", "<br>")


def markdown_table(rows: list[dict], columns: tuple[str, ...] = ROLLOUT_COLUMNS) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(_md_cell(r.get(c)) for c in columns) + " |\n" for r in rows)


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
        *,
        mlflow_tracking_uri: str = "",
        mlflow_experiment: str = "",
    ):
        """config: the run's config as a nested dict (`dataclasses.asdict(cfg)`), for W&B's config and
        MLflow's params. A tracker whose key is set but whose package is missing raises TrackerMissing
        here (the preflight says so first, before Ray starts: `tracker_problems`)."""
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
            wandb = _import_tracker("logging.wandb_project")
            self._wandb = wandb.init(
                project=wandb_project,
                entity=wandb_entity or None,
                name=run_name,
                config=config,
                resume="allow",
                id=wandb_run_id(Path(run_dir), run_name),
            )
        self._mlflow = None
        if mlflow_tracking_uri:
            self._mlflow = _MLflowRun(
                Path(run_dir),
                mlflow_tracking_uri,
                mlflow_experiment or DEFAULT_MLFLOW_EXPERIMENT,
                run_name,
                config,
                resumed_at=start_step,
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
        """Cut the record back to `step` (a resume point). The rows cut, steps a resumed run runs again, are
        appended to `metrics.superseded.jsonl` first, each with the step it was superseded from."""
        if not self.path.exists():
            return
        records = read_metrics(self.path.parent)
        keep = [r for r in records if r.get("step", 0) <= step]
        cut = [{**r, "superseded_at_resume_from": step} for r in records if r.get("step", 0) > step]
        if cut:
            with open(self.path.with_name("metrics.superseded.jsonl"), "a") as fh:
                fh.write("".join(json.dumps(r) + "\n" for r in cut))
                fh.flush()
                os.fsync(fh.fileno())
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
        if self._mlflow is not None:
            self._mlflow.log_metrics(step, numeric)
        self._watched.update(watched(numeric))
        status = "  ".join(f"{k} {v:.3g}" for k, v in self._watched.items())
        self._progress.update(self._task, completed=step, status=status)
        if step % self.console_every == 0:
            self.console.print(self.line(step, numeric), highlight=False, soft_wrap=True)

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        """A table of a step's samples (rows as in `rollouts/step_<N>.jsonl`) to each tracker that is on:
        TensorBoard text `rollouts` (Markdown), W&B table `rollouts`, MLflow artifact
        `rollouts/step_<N>.json`. At most TRACKER_ROWS rows (the best and the worst rewards), prompt and
        response cut to about TRACKER_TEXT_CHARS; the file in the run directory keeps them all. Call it
        before or with the step's `log`: W&B drops what is logged at a step below its newest."""
        if not rows or (self._tb is None and self._wandb is None and self._mlflow is None):
            return
        shown = tracker_rows(rows)
        if self._tb is not None:
            self._tb.add_text("rollouts", markdown_table(shown), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            table = wandb.Table(
                columns=list(ROLLOUT_COLUMNS), data=[[r[c] for c in ROLLOUT_COLUMNS] for r in shown]
            )
            self._wandb.log({"rollouts": table}, step=step)
        if self._mlflow is not None:
            self._mlflow.log_table(step, shown)

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
        if self._mlflow is not None:
            self._mlflow.close()


def wandb_run_id(run_dir: Path, run_name: str) -> str:
    """The W&B run id of this run directory: kept in it (WANDB_RUN_ID_FILE) from its first start, so a resume
    logs into the same W&B run and another directory of the same run.name into a new one. The id is the
    name (W&B ids allow letters, digits, '-', '_' and '.': sweep run names hold '/', '=' and ',') and 8 random
    hex digits."""
    id_file = run_dir / WANDB_RUN_ID_FILE
    kept = id_file.read_text().strip() if id_file.exists() else ""
    if kept:
        return kept
    name = re.sub(r"[^\w.-]", "_", run_name)[:55] or "run"
    return _keep_id(id_file, f"{name}-{secrets.token_hex(4)}")


def _keep_id(id_file: Path, run_id: str) -> str:
    """Writes a tracker's run id into the run directory (renamed into place: never a half-written id)."""
    tmp = id_file.with_name(f".{id_file.name}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, id_file)
    return run_id


class _MLflowRun:
    """One sparkrl run as one MLflow run, through MlflowClient (no process-wide active run, so nothing else
    in the driver's process can log into it by accident)."""

    def __init__(self, run_dir: Path, uri: str, experiment: str, run_name: str, config, resumed_at: int):
        _import_tracker("logging.mlflow_tracking_uri")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / MLFLOW_RUN_ID_FILE
        self.run_id = self._existing(id_file)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "sparkrl.resumed_at_step", str(resumed_at))
        else:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
            run = self.client.create_run(
                exp_id, run_name=run_name or None, tags={"sparkrl.run_dir": str(run_dir)}
            )
            self.run_id = _keep_id(id_file, run.info.run_id)
        if config:
            self._log_params(config)

    def _existing(self, id_file: Path) -> str | None:
        """The MLflow run this run directory logged into before, when the tracking server still has it (a
        run directory copied to where another server is configured starts a new MLflow run)."""
        if not id_file.exists():
            return None
        run_id = id_file.read_text().strip()
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return None
        return run_id

    def _log_params(self, config: dict) -> None:
        """The flattened config. A resumed run logs only keys it lacks: MLflow refuses to change a param,
        and a resumed run may change trainer.total_steps."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        from rl.config import flatten

        have = self.client.get_run(self.run_id).data.params
        params = [
            Param(k, (v if isinstance(v, str) else json.dumps(v))[:MAX_PARAM_VAL_LENGTH])
            for k, v in sorted(flatten(config).items())
            if k not in have
        ]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in sorted(metrics.items())]
        for i in range(0, len(batch), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + MAX_METRICS_PER_BATCH])

    def log_table(self, step: int, rows: list[dict]) -> None:
        columns = {c: [r[c] for r in rows] for c in ROLLOUT_COLUMNS}
        self.client.log_table(self.run_id, data=columns, artifact_file=f"rollouts/step_{step}.json")

    def close(self) -> None:
        # close() runs in the driver's `finally`: an exception on its way out there marks the MLflow run
        # failed (killed for Ctrl-C), not finished.
        exc = sys.exc_info()[1]
        status = "FINISHED" if exc is None else "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        self.client.set_terminated(self.run_id, status=status)
