"""Math reward: verl's `math_dapo.compute_score` (default) or math-verify, and a pool that scores a batch.

`score(response, ground_truth)` returns `{"score": +1.0 | -1.0, "acc": bool, "pred": str}` exactly as verl's
math_dapo does: the last "Answer:" line of the response's last 300 characters, normalised (units, `\\text`,
thousands separators of plain integers ...), compared with the normalised ground truth; without one, a
`\\boxed{}` in the last 100 characters compared verbatim. `pred` is "[INVALID]" when neither is found.

`RewardPool` scores in worker processes with a per-sample timeout: a sample past it has its worker killed
and replaced, and like any other failure it scores as wrong (-1) and is counted (`reward/errors`).
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing as mp
import signal
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.core.batch import Sample

INVALID = "[INVALID]"
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


# The pool --------------------------------------------------------------------------------------------


@dataclass
class RewardResults:
    """One `{"score", "acc", "pred"}` per response, in order; failures score -1 with pred "[ERROR]"."""

    results: list[dict]
    errors: int = 0  # failed samples, timeouts included
    timeouts: int = 0
    messages: list[str] = field(default_factory=list)  # "sample <i>: <reason>", one per failure

    def metrics(self) -> dict[str, float]:
        return {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}

    def fail(self, i: int, pred: str, reason: str) -> None:
        """Score sample `i` as wrong and count it."""
        self.results[i] = {"score": -1.0, "acc": False, "pred": pred}
        self.errors += 1
        self.messages.append(f"sample {i}: {reason}")


ERROR_PRED = "[ERROR]"
TIMEOUT_PRED = "[TIMEOUT]"


def _worker_main(conn, backend: Backend) -> None:
    # The parent owns shutdown; a Ctrl-C in the driver would otherwise print a traceback per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _backend_fn(backend)  # the grader's imports, before the first sample's clock starts
    conn.send(READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        response, ground_truth = task
        try:
            out = ("ok", score(response, ground_truth, backend))
        except Exception as e:  # a failure scores as wrong in the parent; keep the worker alive
            out = ("error", f"{type(e).__name__}: {str(e)[:200]}")
        conn.send(out)


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


class RewardPool:
    """`num_workers` scoring processes; a sample taking over `timeout_s` seconds kills its worker.

    `num_workers=0` scores in the calling process, without the timeout (for debugging). One `score_batch`
    at a time; use as a context manager or call `close()`.
    """

    def __init__(
        self,
        num_workers: int = 4,
        timeout_s: float = 10.0,
        backend: Backend = "math_dapo",
        start_method: str | None = None,
    ):
        if num_workers < 0:
            raise ValueError(f"RewardPool: num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s must be positive, got {timeout_s}")
        _backend_fn(backend)  # an unknown name or a missing package fails here, not once per sample
        self.num_workers, self.timeout_s, self.backend = num_workers, float(timeout_s), backend
        # forkserver: no fork of a driver that holds threads (Ray, torch), and replacements start fast.
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context(start_method or ("forkserver" if "forkserver" in methods else "spawn"))
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        self._workers.extend(self._start() for _ in range(num_workers))

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.backend), daemon=True, name="sparkrl-reward"
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

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[str]) -> RewardResults:
        """Score `responses[i]` against `ground_truths[i]`; never raises for a bad response."""
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"score_batch: {len(responses)} responses but {len(ground_truths)} ground truths"
            )
        for i, (r, g) in enumerate(zip(responses, ground_truths)):
            _check_pair(r, g, f"score_batch sample {i}")
        out = RewardResults(results=[None] * len(responses))
        if self.num_workers == 0:
            for i, (r, g) in enumerate(zip(responses, ground_truths)):
                try:
                    out.results[i] = score(r, g, self.backend)
                except Exception as e:
                    out.fail(i, ERROR_PRED, f"{type(e).__name__}: {str(e)[:200]}")
            return out
        if not self._workers:
            raise RuntimeError("RewardPool.score_batch: the pool is closed")

        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (sample, deadline)
        try:
            self._run(responses, ground_truths, busy, out)
        except BaseException:
            # A busy worker's late reply would be read as the next batch's: replace them all.
            for slot in busy:
                self._replace(slot)
            raise
        return out

    def _run(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        busy: dict[int, tuple[int, float]],
        out: RewardResults,
    ) -> None:
        todo = deque(range(len(responses)))
        deaths = 0  # in a row, with no reply in between: a worker that cannot start, not a bad sample
        while todo or busy:
            for slot in range(len(self._workers)):
                if slot in busy or not todo:
                    continue
                i = todo.popleft()
                try:
                    self._await_ready(slot)
                    self._workers[slot].conn.send((responses[i], ground_truths[i]))
                except (OSError, EOFError):  # died while idle or starting: not this sample's fault
                    todo.appendleft(i)
                    self._replace(slot)
                    deaths += 1
                    self._check_deaths(deaths)
                    continue
                busy[slot] = (i, time.monotonic() + self.timeout_s)
            if not busy:
                continue
            next_deadline = min(deadline for _, deadline in busy.values())
            ready = wait(
                [self._workers[s].conn for s in busy], timeout=max(0.0, next_deadline - time.monotonic())
            )
            now = time.monotonic()
            for slot in list(busy):
                i, deadline = busy[slot]
                worker = self._workers[slot]
                if worker.conn in ready:
                    del busy[slot]
                    try:
                        status, payload = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(timeout=1)
                        out.fail(i, ERROR_PRED, f"worker died (exit code {worker.process.exitcode})")
                        self._replace(slot)
                        deaths += 1
                        self._check_deaths(deaths)
                        continue
                    deaths = 0
                    if status == "ok":
                        out.results[i] = payload
                    else:
                        out.fail(i, ERROR_PRED, payload)
                elif now >= deadline:
                    del busy[slot]
                    out.timeouts += 1
                    out.fail(i, TIMEOUT_PRED, f"timed out after {self.timeout_s:g} s; worker replaced")
                    self._replace(slot)

    def score_samples(self, samples: Sequence[Sample], responses: Sequence[str]) -> RewardResults:
        """Score decoded `responses` against each sample's ground truth and fill `reward`, `acc`, `pred`."""
        if len(samples) != len(responses):
            raise ValueError(f"score_samples: {len(samples)} samples but {len(responses)} responses")
        out = self.score_batch(responses, [s.ground_truth for s in samples])
        for s, r in zip(samples, out.results):
            s.reward, s.acc, s.pred = r["score"], r["acc"], r["pred"]
        return out


def score_batch(
    responses: Sequence[str],
    ground_truths: Sequence[str],
    timeout_s: float = 10.0,
    num_workers: int = 4,
    backend: Backend = "math_dapo",
) -> RewardResults:
    """Score a batch with a pool that lives for this call (keep a `RewardPool` to reuse the workers)."""
    with RewardPool(min(num_workers, len(responses)), timeout_s, backend) as pool:
        return pool.score_batch(responses, ground_truths)
