"""Evaluation: mean@k, maj@k and best@k per data source from per-sample records, and the records' JSONL.

With k samples per problem:
- mean@k: accuracy averaged over a problem's k samples, then over problems (DAPO's avg@32);
- maj@k: the answer most samples gave is right (samples with no extracted answer do not vote; a tie goes
  to the answer given first);
- best@k: any of the k samples is right.

Metric names: `val-core/<data_source>/acc/{mean,maj,best}@<k>`, and `val-core/<data_source>/reward/mean@<k>`
(the scores averaged, verl's name: a reward with partial credit shows there). A source whose checker names
no answer (`pred`; a function of the user's own may not) has no maj@k. Records go to `eval/step_<N>.jsonl` in the
run directory, one JSON object per sample, written to a temporary file and renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from rl.reward import ERROR_PRED, INVALID, NO_PRED, TIMEOUT_PRED

if TYPE_CHECKING:
    from rl.core.batch import Sample

NO_ANSWER = frozenset({INVALID, ERROR_PRED, TIMEOUT_PRED, NO_PRED})


@dataclass
class EvalRecord:
    """One scored sample. `problem` identifies the problem within its data source (the rollout group)."""

    data_source: str
    problem: int | str
    sample: int  # 0 .. k-1
    ground_truth: str
    pred: str
    acc: bool
    score: float
    response: str = ""
    finish_reason: str = ""
    response_length: int = 0  # tokens
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.acc, bool):
            raise TypeError(f"EvalRecord.acc must be a bool, got {type(self.acc).__name__} {self.acc!r}")
        if not isinstance(self.problem, int | str) or isinstance(self.problem, bool):
            raise TypeError(f"EvalRecord.problem must be an int or str, got {type(self.problem).__name__}")
        if not isinstance(self.sample, int) or isinstance(self.sample, bool) or self.sample < 0:
            raise TypeError(f"EvalRecord.sample must be a non-negative int, got {self.sample!r}")


def mean_at_k(accs: Sequence[bool]) -> float:
    """Fraction of one problem's samples that are right."""
    if not accs:
        raise ValueError("mean_at_k: no samples")
    return sum(map(bool, accs)) / len(accs)


def best_at_k(accs: Sequence[bool]) -> float:
    """1.0 if any of one problem's samples is right."""
    if not accs:
        raise ValueError("best_at_k: no samples")
    return float(any(accs))


def maj_at_k(preds: Sequence[str], accs: Sequence[bool]) -> float:
    """1.0 if the most common extracted answer is right; no answer votes; a tie goes to the first given."""
    if len(preds) != len(accs) or not preds:
        raise ValueError(f"maj_at_k: {len(preds)} answers and {len(accs)} accuracies; need equal, non-zero")
    votes: dict[str, int] = {}
    right: dict[str, bool] = {}
    for pred, acc in zip(preds, accs):
        if pred in NO_ANSWER:
            continue
        votes[pred] = votes.get(pred, 0) + 1
        right.setdefault(pred, bool(acc))
    if not votes:
        return 0.0
    winner = max(votes, key=votes.__getitem__)  # max keeps the first of equals: insertion order
    return float(right[winner])


def eval_metrics(records: Iterable[EvalRecord], k: int | None = None) -> dict[str, float]:
    """`val-core/<data_source>/acc/{mean,maj,best}@<k>` for every data source in `records`.

    Every problem must have the same number of samples (`k`, when given); records may come in any order.
    """
    by_source: dict[str, dict[int | str, dict[int, EvalRecord]]] = {}
    for r in records:
        samples = by_source.setdefault(r.data_source, {}).setdefault(r.problem, {})
        if r.sample in samples:
            raise ValueError(
                f"eval_metrics: data source {r.data_source!r}, problem {r.problem!r} has sample {r.sample} twice"
            )
        samples[r.sample] = r
    if not by_source:
        raise ValueError("eval_metrics: no records")

    metrics: dict[str, float] = {}
    for source in sorted(by_source):
        problems = by_source[source]
        source_k = k if k is not None else len(next(iter(problems.values())))
        means, majs, bests, rewards = [], [], [], []
        voting = any(r.pred != NO_PRED for samples in problems.values() for r in samples.values())
        for problem, samples in problems.items():
            if len(samples) != source_k:
                raise ValueError(
                    f"eval_metrics: data source {source!r}, problem {problem!r} has {len(samples)} samples, "
                    f"expected {source_k}{' (k)' if k is not None else ' like its first problem'}"
                )
            ordered = [samples[i] for i in sorted(samples)]
            accs = [r.acc for r in ordered]
            means.append(mean_at_k(accs))
            majs.append(maj_at_k([r.pred for r in ordered], accs))
            bests.append(best_at_k(accs))
            rewards.append(sum(r.score for r in ordered) / len(ordered))
        prefix = f"val-core/{source}/acc"
        metrics[f"{prefix}/mean@{source_k}"] = sum(means) / len(means)
        if voting:
            metrics[f"{prefix}/maj@{source_k}"] = sum(majs) / len(majs)
        metrics[f"{prefix}/best@{source_k}"] = sum(bests) / len(bests)
        metrics[f"val-core/{source}/reward/mean@{source_k}"] = sum(rewards) / len(rewards)
    return metrics


def records_from_samples(samples: Sequence[Sample], responses: Sequence[str]) -> list[EvalRecord]:
    """Records for scored samples and their decoded responses; `sample` counts within each group."""
    if len(samples) != len(responses):
        raise ValueError(f"records_from_samples: {len(samples)} samples but {len(responses)} responses")
    seen: dict[tuple[str, int], int] = {}
    out = []
    for i, (s, text) in enumerate(zip(samples, responses)):
        if s.acc is None or s.reward is None or s.pred is None:
            raise ValueError(
                f"records_from_samples: sample {i} (group {s.group}) has no reward; score it first"
            )
        key = (s.data_source, s.group)
        seen[key] = seen.get(key, -1) + 1
        out.append(
            EvalRecord(
                data_source=s.data_source,
                problem=s.group,
                sample=seen[key],
                ground_truth=s.ground_truth,
                pred=s.pred,
                acc=bool(s.acc),
                score=float(s.reward),
                response=text,
                finish_reason=s.finish_reason,
                response_length=s.num_generated,
            )
        )
    return out


def records_path(run_dir: str | os.PathLike, step: int) -> Path:
    """`<run_dir>/eval/step_<step>.jsonl`."""
    return Path(run_dir) / "eval" / f"step_{step}.jsonl"


def write_records(path: str | os.PathLike, records: Iterable[EvalRecord]) -> Path:
    """Write one JSON object per record; readers never see a partial file (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


_FIELDS = {f.name for f in fields(EvalRecord)}
_REQUIRED = ("data_source", "problem", "sample", "ground_truth", "pred", "acc", "score")


def read_records(path: str | os.PathLike) -> list[EvalRecord]:
    """The records `write_records` wrote; a bad line is an error that names the file, line and key."""
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in _REQUIRED if k not in obj]
            if missing:
                raise ValueError(f"{path}:{lineno}: record lacks key(s) {missing}")
            unknown = sorted(set(obj) - _FIELDS)
            if unknown:
                raise ValueError(f"{path}:{lineno}: unknown key(s) {unknown}; expected {sorted(_FIELDS)}")
            try:
                out.append(EvalRecord(**obj))
            except TypeError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    return out
