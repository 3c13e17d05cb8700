"""GRPO steps through the real driver (rl.driver.Run): each step's KL, timings and the sync's share.

The config's run, for `trainer.total_steps` steps (no checkpoints, no eval unless the overrides ask), into
its own run directory; then its metrics.jsonl as the rows. `rollout_corr/k3_kl` of each step is the KL
budget's figure; `perf/sync_s` against `perf/step_s` is the share of a step the adapter sync takes.

`--max-staleness 0,1` runs the config once for each `rollout.max_staleness`, one after another on the same
seed, and adds to each run's median row `step_s_vs_first`: its median step time over that of the first value
listed (with 0 first: the asynchronous loop's step time over the synchronous one's).

    python -m bench.grpo RECIPE [key=value ...] trainer.total_steps=20 [--max-staleness 0,1]
"""

from __future__ import annotations

import json
import time

from bench.common import Bench, main, median

KEYS = {  # row field <- metrics.jsonl key
    "k3_kl": "rollout_corr/k3_kl",
    "reward_mean": "reward/mean",
    "response_length_mean": "response_length/mean",
    "step_s": "perf/step_s",
    "rollout_s": "perf/rollout_s",
    "train_s": "perf/train_s",
    "sync_s": "perf/sync_s",
    "rollout_tokens_per_s": "perf/rollout_tokens_per_s",
    "train_tokens_per_s": "perf/train_tokens_per_s",
    "r3_replayed_fraction": "r3/replayed_fraction",
    "staleness": "rollout/staleness",
    "overlap_s": "perf/rollout_overlap_s",
    "policy_lag_k3_kl": "rollout/policy_lag_k3_kl",
}


def rows_from_metrics(path) -> list[dict]:
    """One row per step of a run's metrics.jsonl, and a last row `median` over the steps after the first
    (the first step compiles and warms the engine)."""
    steps = [json.loads(line) for line in open(path) if line.strip()]
    steps = [m for m in steps if "perf/step_s" in m]
    rows = [{"step": m["step"], **{k: m.get(key) for k, key in KEYS.items()}} for m in steps]
    later = rows[1:] or rows
    summary = {"step": "median"}
    for k in KEYS:
        values = [r[k] for r in later if r[k] is not None]
        summary[k] = median(values) if values else None
    if summary["sync_s"] is not None:
        summary["sync_share"] = summary["sync_s"] / summary["step_s"]
    return rows + [summary]


def run_steps(cfg) -> list[dict]:
    """`trainer.total_steps` steps of `cfg` into a run directory of their own; the rows of its metrics."""
    from rl.config import run_dir
    from rl.driver import Run

    cfg.run.name = f"{cfg.run.name}-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg.run.dir = ""
    cfg.trainer.checkpoint_every = 0
    run = Run(cfg)
    try:
        for step in range(1, cfg.trainer.total_steps + 1):
            run.step = step
            run.log.log(step, run.train_step(step))
    finally:
        run.log.close()
        run.close()
    return rows_from_metrics(run_dir(cfg) / "metrics.jsonl")


def measure(s, args) -> list[dict]:
    from rl.config import load_config

    if not args.max_staleness:
        return run_steps(s.cfg)
    rows, first = [], None
    for k in args.max_staleness:
        # load_config validates each value as `sparkrl train` would (colocated GPU placement refuses k > 0)
        cfg = load_config(args.recipe, [*args.overrides, f"rollout.max_staleness={k}"])
        cfg.run.name = f"{cfg.run.name}-k{k}"
        run_rows = [{"max_staleness": k, **r} for r in run_steps(cfg)]
        summary = run_rows[-1]
        first = summary["step_s"] if first is None else first
        summary["step_s_vs_first"] = summary["step_s"] / first
        rows += run_rows
    return rows


def _args(p) -> None:
    p.add_argument(
        "--max-staleness",
        type=lambda t: [int(x) for x in t.split(",")],
        default=None,
        help="comma-separated rollout.max_staleness values, one run each (default: the config's own)",
    )


BENCH = Bench(
    name="grpo",
    doc=__doc__.splitlines()[0],
    columns=(
        "max_staleness",
        "step",
        "k3_kl",
        "reward_mean",
        "step_s",
        "rollout_s",
        "train_s",
        "sync_s",
        "sync_share",
        "rollout_tokens_per_s",
        "staleness",
        "overlap_s",
        "step_s_vs_first",
    ),
    measure=measure,
    add_args=_args,
    rollout=False,
    trainer=lambda cfg: False,
)

if __name__ == "__main__":
    raise SystemExit(main(BENCH))
