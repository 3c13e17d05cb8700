"""Adapter sync: from the trainer's export to the first token generated with the new policy.

The driver's step 6 (`sync.mode=adapter`: the LoRA tensors, cast to `model.dtype`, from the trainer's
object store into each engine; `merged`: the merged weights), `--repeats` times, each a new adapter
version; the median of each part is the figure:
  sync_s         export, transfer and load as the driver calls them (Run._export_weights, _load_weights);
  load_s         the pool's own load (`perf/sync_s` of the pool: conversion, staging, vLLM's add_lora);
  first_token_s  a one-token generate on a fresh prompt with the new policy;
  baseline_first_token_s  the same generate with no policy change: generation's share, not the sync's.
The adapter's size follows `lora.rank`, `lora.target_modules`, `lora.target_experts`.

    python -m bench.sync RECIPE [key=value ...] --repeats 3
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import Bench, main, median, sync_adapter


def _one_token(s, seed: int) -> float:
    from rollout.spec import PromptRequest, SamplingSpec

    prompt = np.random.default_rng(seed).integers(10, len(s.tokenizer) - 1, size=64).tolist()
    t = time.perf_counter()
    s.rollout.generate([PromptRequest(prompt, 0)], SamplingSpec(max_tokens=1, seed=seed))
    return time.perf_counter() - t


def measure(s, args) -> list[dict]:
    runs = []
    for i in range(args.repeats):
        t = time.perf_counter()
        m = sync_adapter(s, 1 + i)
        sync_s = time.perf_counter() - t
        runs.append(
            {
                "sync_s": sync_s,
                "load_s": m.get("perf/sync_s", float("nan")),
                "bytes": m.get("perf/sync_bytes", float("nan")),
                "first_token_s": _one_token(s, 100 + i),
                "baseline_first_token_s": _one_token(s, 200 + i),
            }
        )
    row = {k: median([r[k] for r in runs]) for k in runs[0]}
    row["total_s"] = row["sync_s"] + row["first_token_s"]
    row["gb_per_s"] = row["bytes"] / row["total_s"] / 1e9
    lo = s.cfg.lora
    row.update(
        mode=s.cfg.sync.mode,
        rank=lo.rank,
        targets="attention + experts" if lo.target_experts else "attention",
        repeats=args.repeats,
        mb=row["bytes"] / 1e6,
    )
    return [row]


def _args(p) -> None:
    p.add_argument("--repeats", type=int, default=3)


BENCH = Bench(
    name="sync",
    doc=__doc__.splitlines()[0],
    columns=(
        "mode",
        "rank",
        "targets",
        "mb",
        "sync_s",
        "load_s",
        "first_token_s",
        "baseline_first_token_s",
        "total_s",
        "gb_per_s",
    ),
    measure=measure,
    add_args=_args,
)

if __name__ == "__main__":
    raise SystemExit(main(BENCH))
