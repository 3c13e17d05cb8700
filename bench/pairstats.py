"""The statistics of paired rollout runs (bench/paired.py): one call's cost, the cost pooled over calls with a
95 % interval, and the host-speed probe that the pooled cost can be adjusted by.

Why a probe: on the H200 machine the bench's rollout is host-bound (the device ~38 % busy), and the host's
speed drifts: the same batch took 1.6x longer in one run than in another, and the engine's CPU seconds grew
with the wall time (slope -1 in log, every call of the ninth session), so a slow run did the same host work
on a slower host rather than wait. Two runs a few seconds apart still differ by ~10 %, which leaves a 3 %
goal unresolved after a hundred pairs. `host_probe_seconds` times a fixed piece of Python work at the quiet
moment before each run (both engines idle, after the settle pause, so neither engine's own work can slow
it); a run's host speed is the mean of the probes on either side of it. `pooled_cost(adjust=True)` removes
from each pair's log ratio the part its probe ratio predicts (one slope, fitted within the groups), the
usual covariate adjustment of a paired experiment: it narrows the interval by as much of the noise as the
probe tracks and leaves the figure where it was when the probe tracks none of it.
"""

from __future__ import annotations

import time

import numpy as np

PROBE_ITEMS = 100_000  # ~9 ms of work on a 2020s server core
PROBE_REPEATS = 5


def _probe_work(n: int) -> int:
    # Dict updates, hashing and a sort: the kind of work vLLM's scheduler and output processing do per step.
    counts: dict[int, int] = {}
    for i in range(n):
        k = (i * 2654435761) & 1023
        counts[k] = counts.get(k, 0) + i
    return sorted(counts.values())[-1]


def host_probe_seconds(items: int = PROBE_ITEMS, repeats: int = PROBE_REPEATS) -> float:
    """The median seconds of a fixed piece of Python work: higher when the host is slower."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _probe_work(items)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def run_probes(quiet: list[float]) -> list[float]:
    """Each run's host probe from the probes at the quiet moments around the runs (one before each run and one
    after the last, in time order): the mean of the one before it and the one after it."""
    if len(quiet) < 2:
        raise ValueError(f"need a probe before each run and one after the last, got {len(quiet)}")
    return [(a + b) / 2 for a, b in zip(quiet[:-1], quiet[1:])]


def paired_cost(rates_base: list[float], rates_other: list[float]) -> float:
    """The other engine's cost relative to the base, 1 - other / base, from pairs whose order alternates
    (base first in even pairs). Whichever engine ran second was slower, on the CPU machine and by a few % on
    the H200 too, so the median is taken per order and the two log ratios averaged: that cancels an order
    effect of either sign."""
    logs = np.log(np.asarray(rates_other) / np.asarray(rates_base))
    return float(-np.expm1(mean_of_medians([x for x in (logs[0::2], logs[1::2]) if len(x)])))


def mean_of_medians(groups) -> float:
    """The mean of the groups' medians: the log ratio of a set of pairs split by order, each order weighing
    the same however many pairs it has (`paired_cost` within a call, `pooled_cost` over calls)."""
    return float(np.mean([np.median(g) for g in groups]))


def within_slope(ys: list[np.ndarray], xs: list[np.ndarray]) -> float:
    """The least-squares slope of y on x within groups (each group's means removed): the order effects that
    the groups stand for cannot lean on it. 0 where x does not vary."""
    sxy = sum(float(np.sum((x - x.mean()) * (y - y.mean()))) for x, y in zip(xs, ys))
    sxx = sum(float(np.sum((x - x.mean()) ** 2)) for x in xs)
    return sxy / sxx if sxx > 0 else 0.0


def _adjusted_figure(ys: list[np.ndarray], xs: list[np.ndarray] | None) -> tuple[float, float | None]:
    """(mean of the groups' medians of y - slope * x, slope); y alone, slope None, without x. x = 0 is a
    pair whose two runs had the same host speed, so the figure is the cost at equal host speed."""
    if xs is None:
        return mean_of_medians(ys), None
    slope = within_slope(ys, xs)
    return mean_of_medians([y - slope * x for x, y in zip(xs, ys)]), slope


def pooled_cost(
    rows: list[dict],
    base_key: str,
    other_key: str,
    batch: int,
    draws: int = 4000,
    adjust: bool = False,
    mode: str = "alternating",
) -> dict | None:
    """`other_key`'s cost relative to `base_key` at one batch size from every pair of the two in `rows`,
    whichever of them was the base of its call: 1 - tok/s(other) / tok/s(base), with a 95 % interval.

    Pooling several calls matters because one call's pairs share more than the two engines: the engine
    started second ran up to 25 % slower in an A/A pair on the H200 (the eighth session), so calls with each
    engine started first are needed for that to cancel. Each pair's log ratio is put in `other`'s
    orientation and filed under which engine was started first in its call and which ran first within the
    pair (pair i of a call: its base first in even i); the figure is the mean of those (up to four) groups'
    medians, so that neither order weighs more because it has more pairs, and the interval the 2.5 and 97.5
    percentiles of that figure over bootstrap resamples within each group (a fixed seed: the same pairs give
    the same interval, in whatever order; None with fewer than 3 pairs in a group). None when no such pair
    is there.

    `adjust`: the same after removing from each pair the part of its log ratio that its host-probe ratio
    predicts (module docstring; the slope refitted in every resample, and returned as `host_slope`); None
    when a call in `rows` has no probes (calls made before the probe).

    `mode`: the calls pooled, "alternating" (one GPU, the engines' runs in turn; rows from before the mode
    was recorded are these) or "concurrent" (`--pair-concurrent`, one GPU each, both runs at once: there
    "started first" is the engine on the first GPU, and "ran first" splits the pairs into two halves)."""
    # (other started first, other ran first) -> its pairs' (log ratio, probe log ratio or None)
    groups: dict[tuple[bool, bool], list[tuple[float, float | None]]] = {}
    calls = pairs_other_started_first = 0
    for r in rows:
        if r.get("batch") != batch or not r.get("paired_costs_all"):
            continue
        if r.get("paired_mode", "alternating") != mode:
            continue
        pair = (r.get("paired_with"), r.get("config"))
        if pair not in ((base_key, other_key), (other_key, base_key)):
            continue
        probes = r.get("paired_probe_log_ratios")
        if adjust and not probes:
            return None
        flipped = pair[0] == other_key  # that call's base was `other`, and it was started first
        sign = -1.0 if flipped else 1.0
        calls += 1
        for i, c in enumerate(r["paired_costs_all"]):
            log_ratio = float(np.log1p(-c))  # log(tok/s of that call's other / its base)
            x = sign * probes[i] if adjust else None  # log(probe of `other`'s run / probe of `base`'s run)
            call_base_first = i % 2 == 0
            groups.setdefault((flipped, call_base_first == flipped), []).append((sign * log_ratio, x))
            pairs_other_started_first += flipped
    if not calls:
        return None
    # Groups and their pairs in a fixed order, so that the bootstrap's draws, and the interval, do not
    # depend on the order the calls were read in.
    ordered = [sorted(groups[k], key=lambda yx: (yx[0], yx[1] or 0.0)) for k in sorted(groups)]
    ys = [np.asarray([y for y, _ in g]) for g in ordered]
    xs = [np.asarray([x for _, x in g]) for g in ordered] if adjust else None
    figure, slope = _adjusted_figure(ys, xs)
    lo = hi = None
    if min(len(y) for y in ys) >= 3:
        rng = np.random.default_rng(0)
        boot = []
        for _ in range(draws):
            picks = [rng.integers(0, len(y), size=len(y)) for y in ys]
            drawn_xs = None if xs is None else [x[p] for x, p in zip(xs, picks)]
            boot.append(_adjusted_figure([y[p] for y, p in zip(ys, picks)], drawn_xs)[0])
        low_log, high_log = np.percentile(boot, [2.5, 97.5])
        lo, hi = float(-np.expm1(high_log)), float(-np.expm1(low_log))  # a higher log ratio is a lower cost
    return {
        "cost": float(-np.expm1(figure)),
        "lo": lo,
        "hi": hi,
        "pairs": sum(len(y) for y in ys),
        "calls": calls,
        "pairs_other_started_first": pairs_other_started_first,
        "host_slope": slope,
    }


def paired_mean_difference(sums_a, sums_b, counts, draws: int = 4000) -> dict:
    """sum(a) / sum(n) - sum(b) / sum(n) over units that were each measured twice (a sequence's k3 summed over
    its n tokens, scored with R3 and without), with a 95 % interval from resampling the units (a fixed seed).
    The pairing is what makes a small difference readable: two scorings of the same tokens share most of
    their noise. `relative`: the difference over b's mean."""
    a, b, n = (np.asarray(v, dtype=np.float64) for v in (sums_a, sums_b, counts))
    if not (a.shape == b.shape == n.shape) or a.ndim != 1 or len(a) < 2 or n.sum() <= 0:
        raise ValueError(f"need two or more units, the same number each: got {a.shape}, {b.shape}, {n.shape}")
    diff = a - b
    figure = float(diff.sum() / n.sum())
    picks = np.random.default_rng(0).integers(0, len(a), size=(draws, len(a)))
    lo, hi = np.percentile(diff[picks].sum(1) / n[picks].sum(1), [2.5, 97.5])
    return {
        "diff": figure,
        "lo": float(lo),
        "hi": float(hi),
        "relative": figure / float(b.sum() / n.sum()) if b.sum() > 0 else None,
        "units": len(a),
    }
