"""Rewards: verl's `math_dapo.compute_score` (default) or math-verify, functions of the user's own (by
import path, verl's signature), per data source, and a pool that scores a batch.

`score(response, ground_truth)` returns `{"score": +1.0 | -1.0, "acc": bool, "pred": str}` exactly as verl's
math_dapo does: the last "Answer:" line of the response's last 300 characters, normalised (units, `\\text`,
thousands separators of plain integers ...), compared with the normalised ground truth; without one, a
`\\boxed{}` in the last 100 characters compared verbatim. `pred` is "[INVALID]" when neither is found.

A function of the user's own (`reward.function`, `reward.by_source`; rl.core.user_code resolves it in the
process that calls it) is called as verl's reward managers call it: `name(data_source=, solution_str=,
ground_truth=, extra_info=, **reward.kwargs)`, or batched `name(data_sources=, solution_strs=,
ground_truths=, extra_infos=, **kwargs) -> list`. It returns a number (the score; acc = score >= 1) or a
dict with `score`, optional `acc` (a bool, or a number: acc = acc > 0) and `pred`, and further numeric keys
(`reward/<key>` metrics). The math checkers need a non-empty string ground truth; a function of one's own
gets the row's value as it is.

`RewardPool` scores in worker processes with a per-sample timeout: a sample past it has its worker killed
and replaced, and like any other failure it scores as wrong (-1) and is counted (`reward/errors`). The
first traceback of each checker goes to the pool's log (a run's `logs/reward.log`) with the row.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
import multiprocessing as mp
import numbers
import signal
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl.core import user_code

if TYPE_CHECKING:
    from rl.core.batch import Sample

INVALID = "[INVALID]"
NO_PRED = ""  # a function of the user's own that names no `pred`: no answer to vote with (maj@k)
BACKENDS = ("math_dapo", "math_verify")
Backend = str | Callable[[str, str], dict]


def score(response: str, ground_truth: str, backend: Backend = "math_dapo") -> dict:
    """Score one response: `{"score": float, "acc": bool, "pred": str}`.

    `backend` is "math_dapo", "math_verify" (needs `pip install "math-verify[antlr4-9-3]"`) or a picklable
    function `(response, ground_truth) -> dict` of the same shape.
    """
    _check_pair(response, ground_truth, "score")
    out = _backend_fn(backend)(response, ground_truth)
    return {"score": float(out["score"]), "acc": bool(out["acc"]), "pred": str(out["pred"])}


def _check_pair(response: object, ground_truth: object, where: str) -> None:
    if not isinstance(response, str):
        raise TypeError(f"{where}: response must be a str, got {type(response).__name__}")
    if not isinstance(ground_truth, str):
        raise TypeError(
            f"{where}: ground_truth must be a str, got {type(ground_truth).__name__} {ground_truth!r}; "
            "rl.data.sources converts dataset answers to strings"
        )
    if not ground_truth.strip():
        # math_dapo would count an empty \boxed{} as matching it.
        raise ValueError(f"{where}: ground_truth is empty")


def _backend_fn(backend: Backend) -> Callable[[str, str], dict]:
    if callable(backend):
        return backend
    if backend == "math_dapo":
        return _math_dapo().compute_score
    if backend == "math_verify":
        _math_verify()
        return _score_math_verify
    raise ValueError(f"unknown reward backend {backend!r}; expected one of {list(BACKENDS)} or a function")


@functools.cache
def _math_dapo():
    """verl's math_dapo module. It needs only `re`, but importing it through the verl package pulls in torch
    (seconds and hundreds of MB in every pool worker), so the one file is loaded by path."""
    if "verl.utils.reward_score.math_dapo" in sys.modules:
        return sys.modules["verl.utils.reward_score.math_dapo"]
    spec = importlib.util.find_spec("verl")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the math_dapo reward needs verl: pip install verl==0.9.1")
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "reward_score" / "math_dapo.py"
    if not path.is_file():
        raise ImportError(f"the math_dapo reward: verl has no {path}; sparkrl expects verl==0.9.1")
    file_spec = importlib.util.spec_from_file_location("_sparkrl_verl_math_dapo", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            'the math_verify reward backend needs math-verify: pip install "math-verify[antlr4-9-3]" '
            "(the antlr4-9-3 extra keeps the antlr runtime that omegaconf needs)"
        ) from e
    return math_verify


def _score_math_verify(response: str, ground_truth: str) -> dict:
    mv = _math_verify()
    # Its own signal-based timeouts fail off the main thread; the pool's per-sample timeout bounds the time.
    gold = mv.parse("\\boxed{" + ground_truth + "}", (mv.LatexExtractionConfig(),), parsing_timeout=None)
    pred = mv.parse(response, (mv.ExprExtractionConfig(), mv.LatexExtractionConfig()), parsing_timeout=None)
    correct = bool(gold) and bool(pred) and mv.verify(gold, pred, timeout_seconds=None)
    # parse gives [sympy object, matched text]; the text is what a majority vote should compare.
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": str(pred[-1]) if pred else INVALID}


# Functions of the user's own and the spec of a run's scoring ---------------------------------------


@dataclass
class RewardRow:
    """What a response is scored against: its prompt's row (rl.data.loader.Prompt)."""

    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict = field(default_factory=dict)

    @classmethod
    def of_prompt(cls, prompt) -> RewardRow:
        return cls(prompt.data_source, prompt.ground_truth, prompt.extra_info)


@dataclass
class RewardSpec:
    """A run's scoring: the checker of each data source (`by_source`, else `default`), each a built-in name
    (BACKENDS), an import path of the user's own (made absolute on load), or, for tests and callers in
    Python, a picklable function `(response, ground_truth) -> dict` of math_dapo's shape. `kwargs` go to the
    user's functions, which `batched` calls once a batch. Picklable: each worker process resolves it."""

    default: Backend = "math_dapo"
    by_source: dict[str, str] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = False
    default_key: str = "reward.backend"  # the config key the default came from, for messages

    @classmethod
    def of_config(cls, reward) -> RewardSpec:
        """From the `reward:` section (rl.config.RewardConfig)."""
        return cls(
            default=reward.function or reward.backend,
            by_source=dict(reward.by_source),
            kwargs=dict(reward.kwargs),
            batched=reward.batched,
            default_key="reward.function" if reward.function else "reward.backend",
        )

    def checker(self, data_source: str) -> Backend:
        return self.by_source.get(data_source, self.default)

    def key(self, data_source: str) -> str:
        return f"reward.by_source.{data_source}" if data_source in self.by_source else self.default_key

    def checkers(self) -> dict[str, Backend]:
        """Config key -> checker, every one this spec uses."""
        out = {self.default_key: self.default}
        out.update({f"reward.by_source.{s}": c for s, c in self.by_source.items()})
        return out

    def needs_text(self, data_source: str) -> bool:
        """Whether rows of this source need their ground truth as a non-empty string (a built-in checker)."""
        return not is_own(self.checker(data_source))


def is_own(checker: Backend) -> bool:
    """A function of the user's own, named by import path (as opposed to a built-in or a Python callable)."""
    return isinstance(checker, str) and user_code.is_import_path(checker)


def own_function(key: str, checker: str) -> Callable:
    return _own_function(key, checker)


@functools.cache
def _own_function(key: str, checker: str) -> Callable:
    return user_code.resolve(key, checker)


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, str)


def normalise(out: object, key: str, checker: str) -> dict:
    """A user function's return value as `{"score", "acc", "pred", "extra"}`; TypeError/ValueError naming the
    key and the function when it is neither a number nor a dict with a numeric `score`."""
    where = f"{key}: {checker}"
    if _number(out):
        score = float(out)
        if not math.isfinite(score):
            raise ValueError(f"{where} returned {score}")
        return {"score": score, "acc": score >= 1.0, "pred": NO_PRED, "extra": {}}
    if not isinstance(out, dict):
        raise TypeError(f"{where} returned {type(out).__name__}; expected a number or a dict with 'score'")
    if "score" not in out or not _number(out["score"]):
        got = "no 'score'" if "score" not in out else f"'score' {type(out['score']).__name__}"
        raise TypeError(f"{where} returned a dict with {got}; expected a number under 'score'")
    score = float(out["score"])
    if not math.isfinite(score):
        raise ValueError(f"{where} returned score {score}")
    acc = out.get("acc")
    if acc is None:
        acc = score >= 1.0
    elif _number(acc):
        acc = bool(acc) if isinstance(acc, bool) else float(acc) > 0
    else:
        raise TypeError(f"{where} returned 'acc' {type(acc).__name__}; expected a bool or a number")
    pred = out.get("pred")
    extra = {
        k: float(v)
        for k, v in out.items()
        if k not in ("score", "acc", "pred") and _number(v) and math.isfinite(float(v))
    }
    return {"score": score, "acc": acc, "pred": NO_PRED if pred is None else str(pred), "extra": extra}


def score_row(response: str, row: RewardRow, spec: RewardSpec) -> dict:
    """Score one response against its row with the row's checker: `{"score", "acc", "pred", "extra"}`."""
    checker = spec.checker(row.data_source)
    if not is_own(checker):
        out = score(response, row.ground_truth, checker)
        return {**out, "extra": {}}
    key = spec.key(row.data_source)
    fn = own_function(key, checker)
    if spec.batched:
        result = score_rows_batched([response], [row], spec, key, checker)[0]
        if isinstance(result, BaseException):
            raise result
        return result
    out = fn(
        data_source=row.data_source,
        solution_str=response,
        ground_truth=copy.deepcopy(row.ground_truth),
        extra_info=copy.deepcopy(row.extra_info),
        **spec.kwargs,
    )
    return normalise(out, key, checker)


def score_rows_batched(
    responses: Sequence[str], rows: Sequence[RewardRow], spec: RewardSpec, key: str, checker: str
) -> list[dict | BaseException]:
    """One call of a batched function over `rows` -> one result (or the exception normalising it) a row."""
    out = own_function(key, checker)(
        data_sources=[r.data_source for r in rows],
        solution_strs=list(responses),
        ground_truths=[copy.deepcopy(r.ground_truth) for r in rows],
        extra_infos=[copy.deepcopy(r.extra_info) for r in rows],
        **spec.kwargs,
    )
    if not isinstance(out, list | tuple) or len(out) != len(rows):
        got = f"{len(out)} results" if isinstance(out, list | tuple) else type(out).__name__
        raise TypeError(
            f"{key}: {checker} (batched) returned {got} for {len(rows)} responses; expected a list"
        )
    results: list[dict | BaseException] = []
    for item in out:
        try:
            results.append(normalise(item, key, checker))
        except (TypeError, ValueError) as e:
            results.append(e)
    return results


# The pool --------------------------------------------------------------------------------------------


@dataclass
class RewardResults:
    """One `{"score", "acc", "pred"}` per response, in order; failures score -1 with pred "[ERROR]".
    `extras`: each response's further numeric values (a user function's dict keys)."""

    results: list[dict]
    errors: int = 0  # failed samples, timeouts included
    timeouts: int = 0
    messages: list[str] = field(default_factory=list)  # "sample <i>: <reason>", one per failure
    extras: list[dict] = field(default_factory=list)
    logged: list[str] = field(default_factory=list)  # "<key>: <reason>" of tracebacks newly in the log
    responses: list[str] = field(default_factory=list)  # the texts scored, where the caller keeps them

    def __post_init__(self):
        if not self.extras:
            self.extras = [{} for _ in self.results]

    def metrics(self) -> dict[str, float]:
        return {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}

    def fail(self, i: int, pred: str, reason: str) -> None:
        """Score sample `i` as wrong and count it."""
        self.results[i] = {"score": -1.0, "acc": False, "pred": pred}
        self.extras[i] = {}
        self.errors += 1
        self.messages.append(f"sample {i}: {reason}")

    def put(self, i: int, result: dict) -> None:
        self.results[i] = {k: result[k] for k in ("score", "acc", "pred")}
        self.extras[i] = dict(result.get("extra") or {})


ERROR_PRED = "[ERROR]"
TIMEOUT_PRED = "[TIMEOUT]"


@dataclass
class _Job:
    """Samples scored by one call in a worker: one sample, or a batched function's share of the batch."""

    indices: list[int]
    key: str  # the config key of the samples' checker
    batched: bool = False


def _error(e: BaseException) -> tuple[str, str, str]:
    return ("error", f"{type(e).__name__}: {str(e)[:300]}", traceback.format_exc())


def _run_job(spec: RewardSpec, task: tuple) -> tuple:
    """A job's task in this process -> ("ok", result) for one sample, ("ok", [per sample]) for a batched
    call, or ("error", reason, traceback) for the whole job."""
    kind, payload = task
    try:
        if kind == "one":
            response, row = payload
            return ("ok", score_row(response, row, spec))
        responses, rows, key, checker = payload
        out = score_rows_batched(responses, rows, spec, key, checker)
        return (
            "ok",
            [
                ("error", f"{type(r).__name__}: {r}", "") if isinstance(r, BaseException) else ("ok", r)
                for r in out
            ],
        )
    except Exception as e:  # a failure scores as wrong in the parent
        return _error(e)


def _worker_main(conn, spec: RewardSpec) -> None:
    # The parent owns shutdown; a Ctrl-C in the driver would otherwise print a traceback per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _resolve_all(spec)  # the graders' imports, before the first sample's clock starts
    conn.send(READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        conn.send(_run_job(spec, task))


def _resolve_all(spec: RewardSpec) -> None:
    """Every checker of `spec` loaded in this process: an unknown name, a missing package or file fails
    here, not once per sample."""
    for key, checker in spec.checkers().items():
        if is_own(checker):
            own_function(key, checker)
        else:
            _backend_fn(checker)


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: mp.connection.Connection
    ready: bool = False  # sent READY: started and imported its grader


READY = ("ready", None)
# A worker's start (process, imports) is not a sample's time: `timeout_s` counts from READY on. A worker
# that has not started within this bound cannot run here at all.
START_TIMEOUT_S = 300.0


def _stop(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    for w in workers:
        w.process.join(timeout=2)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()
    workers.clear()


def _as_spec(backend: Backend | RewardSpec) -> RewardSpec:
    return backend if isinstance(backend, RewardSpec) else RewardSpec(default=backend)


def _clip(text: str, n: int = 2000) -> str:
    return text if len(text) <= n else text[: n // 2] + f" ...[{len(text) - n} chars]... " + text[-n // 2 :]


class RewardPool:
    """`num_workers` scoring processes; a sample taking over `timeout_s` seconds kills its worker.

    `backend`: a RewardSpec, or one checker for every row (a built-in name, an import path, or a picklable
    function `(response, ground_truth) -> dict`). `num_workers=0` scores in the calling process, without the
    timeout (for debugging). `log_path`: where the first traceback of each checker goes, with its row. One
    `score_*` at a time; use as a context manager or call `close()`.
    """

    def __init__(
        self,
        num_workers: int = 4,
        timeout_s: float = 10.0,
        backend: Backend | RewardSpec = "math_dapo",
        start_method: str | None = None,
        log_path: str | Path | None = None,
    ):
        if num_workers < 0:
            raise ValueError(f"RewardPool: num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s must be positive, got {timeout_s}")
        self.spec = _as_spec(backend)
        _resolve_all(self.spec)  # an unknown name, a missing package or file fails here, not once per sample
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.backend = self.spec.default
        self.log_path = Path(log_path) if log_path else None
        self._logged: set[str] = set()  # checker keys whose first traceback is in the log
        # forkserver: no fork of a driver that holds threads (Ray, torch), and replacements start fast.
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context(start_method or ("forkserver" if "forkserver" in methods else "spawn"))
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        self._workers.extend(self._start() for _ in range(num_workers))

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.spec), daemon=True, name="sparkrl-reward"
        )
        process.start()
        child.close()  # so that the parent sees EOF when the worker dies
        return _Worker(process, parent)

    def _replace(self, slot: int) -> None:
        old = self._workers[slot]
        old.process.kill()
        old.process.join()
        old.conn.close()
        self._workers[slot] = self._start()

    def _await_ready(self, slot: int) -> None:
        """Blocks until worker `slot` has started (READY); EOFError if it died first."""
        worker = self._workers[slot]
        if worker.ready:
            return
        if not worker.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(
                f"RewardPool: a reward worker did not start within {START_TIMEOUT_S:.0f} s "
                f"(backend {self.backend!r})"
            )
        message = worker.conn.recv()
        if message != READY:
            raise RuntimeError(f"RewardPool: a starting reward worker sent {message!r} instead of READY")
        worker.ready = True

    def _check_deaths(self, deaths: int) -> None:
        if deaths > max(8, 2 * len(self._workers)):
            raise RuntimeError(
                f"RewardPool: {deaths} reward workers in a row died without replying; they cannot run here "
                "(a script that starts a pool needs an `if __name__ == '__main__':` guard)"
            )

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> RewardResults:
        """Score `responses[i]` against `ground_truths[i]` (rows of no data source); never raises for a bad
        response."""
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"score_batch: {len(responses)} responses but {len(ground_truths)} ground truths"
            )
        return self.score_rows(responses, [RewardRow(ground_truth=g) for g in ground_truths], "score_batch")

    def score_rows(
        self, responses: Sequence[str], rows: Sequence[RewardRow], where: str = "score_rows"
    ) -> RewardResults:
        """Score `responses[i]` against `rows[i]` with the row's checker; never raises for a bad response. A
        row a built-in checker scores must hold a non-empty string ground truth (a data error: raised)."""
        if len(responses) != len(rows):
            raise ValueError(f"{where}: {len(responses)} responses but {len(rows)} rows")
        for i, (r, row) in enumerate(zip(responses, rows)):
            if not isinstance(r, str):
                raise TypeError(f"{where} sample {i}: response must be a str, got {type(r).__name__}")
            if self.spec.needs_text(row.data_source):
                _check_pair(r, row.ground_truth, f"{where} sample {i}")
        out = RewardResults(results=[None] * len(responses))
        jobs = self._jobs(rows)
        tasks = [self._task(job, responses, rows) for job in jobs]
        if self.num_workers == 0:
            for job, task in zip(jobs, tasks):
                self._receive(job, _run_job(self.spec, task), out, responses, rows)
            return out
        if not self._workers:
            raise RuntimeError("RewardPool.score_rows: the pool is closed")

        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (job, deadline)
        try:
            self._run(jobs, tasks, busy, out, responses, rows)
        except BaseException:
            # A busy worker's late reply would be read as the next batch's: replace them all.
            for slot in busy:
                self._replace(slot)
            raise
        return out

    def _jobs(self, rows: Sequence[RewardRow]) -> list[_Job]:
        """One job a sample; a batched function's samples in one job a worker (its share of them)."""
        jobs, batched = [], {}
        for i, row in enumerate(rows):
            checker, key = self.spec.checker(row.data_source), self.spec.key(row.data_source)
            if self.spec.batched and is_own(checker):
                batched.setdefault(key, []).append(i)
            else:
                jobs.append(_Job([i], key))
        for key, indices in batched.items():
            size = math.ceil(len(indices) / max(1, self.num_workers))
            jobs += [_Job(indices[k : k + size], key, True) for k in range(0, len(indices), size)]
        return jobs

    def _task(self, job: _Job, responses: Sequence[str], rows: Sequence[RewardRow]) -> tuple:
        if not job.batched:
            i = job.indices[0]
            return ("one", (responses[i], rows[i]))
        checker = self.spec.checkers()[job.key]
        return (
            "many",
            ([responses[i] for i in job.indices], [rows[i] for i in job.indices], job.key, checker),
        )

    def _receive(
        self, job: _Job, reply: tuple, out: RewardResults, responses: Sequence[str], rows: Sequence[RewardRow]
    ) -> None:
        """A job's reply into `out`: its results, or its failures (the first traceback of a key logged)."""
        status, payload, *rest = reply
        if status != "ok":
            for i in job.indices:
                out.fail(i, ERROR_PRED, payload)
            self._log(job.key, payload, rest[0] if rest else "", job.indices[0], out, responses, rows)
            return
        if not job.batched:
            out.put(job.indices[0], payload)
            return
        for i, (item_status, item, *item_rest) in zip(job.indices, payload):
            if item_status == "ok":
                out.put(i, item)
            else:
                out.fail(i, ERROR_PRED, item)
                self._log(job.key, item, item_rest[0] if item_rest else "", i, out, responses, rows)

    def _log(
        self,
        key: str,
        reason: str,
        trace: str,
        i: int,
        out: RewardResults,
        responses: Sequence[str],
        rows: Sequence[RewardRow],
    ) -> None:
        """The first failure of each checker, with its traceback and row, to the log."""
        if key in self._logged:
            return
        self._logged.add(key)
        out.logged.append(f"{key}: {reason}")
        if self.log_path is None:
            return
        row = rows[i]
        text = [
            f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {key} ({self.spec.checkers().get(key)}) failed: {reason}",
            f"data_source: {row.data_source!r}",
            f"ground_truth: {_clip(json.dumps(row.ground_truth, ensure_ascii=False, default=repr))}",
            f"extra_info: {_clip(json.dumps(row.extra_info, ensure_ascii=False, default=repr))}",
            f"response: {_clip(json.dumps(responses[i], ensure_ascii=False))}",
            (trace or "(no traceback: the function's return value was refused)").rstrip(),
            "",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write("\n".join(text) + "\n")

    def _run(
        self,
        jobs: list[_Job],
        tasks: list[tuple],
        busy: dict[int, tuple[int, float]],
        out: RewardResults,
        responses: Sequence[str],
        rows: Sequence[RewardRow],
    ) -> None:
        todo = deque(range(len(jobs)))
        deaths = 0  # in a row, with no reply in between: a worker that cannot start, not a bad sample
        while todo or busy:
            for slot in range(len(self._workers)):
                if slot in busy or not todo:
                    continue
                j = todo.popleft()
                try:
                    self._await_ready(slot)
                    self._workers[slot].conn.send(tasks[j])
                except (OSError, EOFError):  # died while idle or starting: not this sample's fault
                    todo.appendleft(j)
                    self._replace(slot)
                    deaths += 1
                    self._check_deaths(deaths)
                    continue
                busy[slot] = (j, time.monotonic() + self.timeout_s * len(jobs[j].indices))
            if not busy:
                continue
            next_deadline = min(deadline for _, deadline in busy.values())
            ready = wait(
                [self._workers[s].conn for s in busy], timeout=max(0.0, next_deadline - time.monotonic())
            )
            now = time.monotonic()
            for slot in list(busy):
                j, deadline = busy[slot]
                job, worker = jobs[j], self._workers[slot]
                if worker.conn in ready:
                    del busy[slot]
                    try:
                        reply = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(timeout=1)
                        for i in job.indices:
                            out.fail(i, ERROR_PRED, f"worker died (exit code {worker.process.exitcode})")
                        self._replace(slot)
                        deaths += 1
                        self._check_deaths(deaths)
                        continue
                    deaths = 0
                    self._receive(job, reply, out, responses, rows)
                elif now >= deadline:
                    del busy[slot]
                    allowed = self.timeout_s * len(job.indices)
                    for i in job.indices:
                        out.timeouts += 1
                        out.fail(i, TIMEOUT_PRED, f"timed out after {allowed:g} s; worker replaced")
                    self._replace(slot)

    def score_samples(
        self, samples: Sequence[Sample], responses: Sequence[str], rows: Sequence[RewardRow] | None = None
    ) -> RewardResults:
        """Score decoded `responses` against each sample's row (default: its data source and ground truth)
        and fill `reward`, `acc`, `pred`, and `extra` (a user function's further numeric values)."""
        if len(samples) != len(responses):
            raise ValueError(f"score_samples: {len(samples)} samples but {len(responses)} responses")
        if rows is None:
            rows = [RewardRow(s.data_source, s.ground_truth) for s in samples]
        out = self.score_rows(responses, rows, "score_samples")
        for s, r, extra in zip(samples, out.results, out.extras):
            s.reward, s.acc, s.pred = r["score"], r["acc"], r["pred"]
            s.extra = dict(extra)
        return out


def score_batch(
    responses: Sequence[str],
    ground_truths: Sequence[str],
    timeout_s: float = 10.0,
    num_workers: int = 4,
    backend: Backend | RewardSpec = "math_dapo",
) -> RewardResults:
    """Score a batch with a pool that lives for this call (keep a `RewardPool` to reuse the workers)."""
    with RewardPool(min(num_workers, len(responses)), timeout_s, backend) as pool:
        return pool.score_batch(responses, ground_truths)


def reward_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`reward/<source>/mean`, `acc/<source>/mean` per data source, and `reward/<key>` (the mean over the
    samples that report it) of every further numeric value a user function returned."""
    by_source: dict[str, list] = {}
    extra: dict[str, list[float]] = {}
    for s in samples:
        by_source.setdefault(s.data_source, []).append(s)
        for k, v in (s.extra or {}).items():
            extra.setdefault(k, []).append(v)
    out = {}
    for source, group in sorted(by_source.items()):
        out[f"reward/{source}/mean"] = sum(float(s.reward) for s in group) / len(group)
        out[f"acc/{source}/mean"] = sum(bool(s.acc) for s in group) / len(group)
    reserved = {"mean", "errors", "timeouts"}
    for k, values in sorted(extra.items()):
        out[f"reward/{k}" if k not in reserved else f"reward/fn_{k}"] = sum(values) / len(values)
    return out


def score_episodes(scorer, samples: Sequence[Sample], responses: Sequence[str], rows: Sequence[RewardRow]):
    """`scorer.score_samples` on the samples without an environment's reward (all of them in one-turn
    rollouts); the others take their environment's (`apply_env_reward`). -> the RewardResults of the
    samples scored."""
    own = [i for i, s in enumerate(samples) if (s.episode or {}).get("reward") is None]
    if len(own) == len(samples):
        return scorer.score_samples(samples, responses, rows)
    for s in samples:
        apply_env_reward(s)
    if not own:
        return RewardResults([])
    pick = [samples[i] for i in own], [responses[i] for i in own], [rows[i] for i in own]
    return scorer.score_samples(*pick)


def apply_env_reward(s: Sample) -> None:
    """A multi-turn episode whose environment returned a reward takes it over the reward function's: a number
    (acc: > 0), or a dict with "score" and optionally "acc" and "pred". Without a "pred" the episode's
    prediction is "" (none, as a checker that found no answer says), which eval records and maj@k need."""
    reward = (s.episode or {}).get("reward")
    if reward is None:
        return
    if isinstance(reward, dict):
        s.reward = float(reward["score"])
        s.acc = bool(reward.get("acc", s.reward > 0))
        s.pred = str(reward["pred"]) if "pred" in reward else s.pred
    else:
        s.reward, s.acc = float(reward), float(reward) > 0
    if s.pred is None:
        s.pred = ""
