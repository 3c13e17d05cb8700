"""GRPO steps through the real driver (rl.driver.Run): each step's KL, timings and the sync's share.

The config's run, for `trainer.total_steps` steps (no checkpoints, no eval unless the overrides ask), into
its own run directory; then its metrics.jsonl as the rows. `rollout_corr/k3_kl` of each step is the KL
budget's figure; `perf/sync_s` against `perf/step_s` is the share of a step the adapter sync takes.

`--max-staleness 0,1` runs the config once for each `rollout.max_staleness`, one after another on the same
seed, and adds to each run's median row `step_s_vs_first`: its median step time over that of the first value
listed (with 0 first: the asynchronous loop's step time over the synchronous one's).

On GPUs, a thread samples the device memory in use (NVML, else nvidia-smi; every process on the GPU: the
engine, the trainer, their CUDA contexts) and each step row gets its peak a phase of the synchronous step:
`mem_rollout_gib` (generation and scoring), `mem_logprob_gib`, `mem_train_gib`, `mem_sync_gib` (the adapter's
hand-over), `mem_step_gib`; the summary row holds the largest of the steps and `sparkrl plan`'s figures beside
them: `plan_rollout_gib` (colocated: the trainer's resident state + vLLM's budget; split: vLLM's budget) and
`plan_train_gib` (the trainer's peak + vLLM asleep), and the measured over the planned. `--peak-tflops`
adds MFU: 6 N T / s over that rate, N the active parameters (routed experts at top_k / num_experts, no
embeddings), T / s the median `perf/train_tokens_per_s`.

`--budget-s S` stops before a step that would end past S seconds from the start of the run (the longest
step so far as its estimate), so that a call with a time limit still writes its table: the steps run are
the rows.

    python -m bench.grpo RECIPE [key=value ...] trainer.total_steps=20 [--max-staleness 0,1] [--peak-tflops R]
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path

from bench.common import Bench, main, median

GiB = 2**30
PHASES = ("rollout", "logprob", "train", "sync")

KEYS = {  # row field <- metrics.jsonl key
    "k3_kl": "rollout_corr/k3_kl",
    "reward_mean": "reward/mean",
    "response_length_mean": "response_length/mean",
    "step_s": "perf/step_s",
    "rollout_s": "perf/rollout_s",
    "logprob_s": "perf/logprob_s",
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


def _nvml_reader():
    """A function giving the most memory in use on any GPU (bytes), by NVML; None without pynvml or GPUs."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no NVML here: the caller tries nvidia-smi
        return None
    return (lambda: max(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)) if handles else None


def _smi_reader():
    """The same by nvidia-smi (MiB); None where it does not answer."""
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]

    def read() -> int:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
        return max(int(x) for x in out.split()) * 2**20

    try:
        read()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return read


class DeviceMemory:
    """Samples `read()` (bytes in use) every `every_s` seconds on a thread: (perf_counter, bytes) pairs."""

    def __init__(self, read, every_s: float = 0.1):
        self.read, self.every_s = read, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="device-memory", daemon=True)

    @classmethod
    def on_gpus(cls, every_s: float = 0.1) -> DeviceMemory | None:
        read = _nvml_reader() or _smi_reader()
        return cls(read, every_s) if read else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter(), self.read()))
            except Exception:  # noqa: BLE001 - a missed sample is no reason to stop the run
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> DeviceMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def phase_windows(t0: float, row: dict) -> dict[str, tuple[float, float]]:
    """[start, end) of each phase of a step that started at t0, from its row's times. The synchronous step
    runs its phases one after another (rollout, log-probs, update, hand-over); an asynchronous one
    (`staleness` in the row) overlaps them, so it gets the whole step only."""
    end = t0 + (row.get("step_s") or 0.0)
    if row.get("staleness") is not None or row.get("rollout_s") is None:
        return {"step": (t0, end)}
    out, t = {}, t0
    for phase in ("rollout", "logprob", "train"):
        d = row.get(f"{phase}_s") or 0.0
        out[phase] = (t, t + d)
        t += d
    out["sync"] = (t, max(t, end))
    out["step"] = (t0, end)
    return out


def add_phase_memory(rows: list[dict], samples: list[tuple[float, int]], starts: dict[int, float]) -> None:
    """Each step row's peak device memory a phase (`mem_<phase>_gib`, None where no sample fell in it); the
    summary row (`step` not an int) gets the largest over the steps."""
    steps = [r for r in rows if isinstance(r["step"], int)]
    for r in steps:
        t0 = starts.get(r["step"])
        if t0 is None:
            continue
        for phase, (a, b) in phase_windows(t0, r).items():
            inside = [used for t, used in samples if a <= t < b]
            r[f"mem_{phase}_gib"] = max(inside) / GiB if inside else None
    for r in rows:
        if not isinstance(r["step"], int):
            for phase in (*PHASES, "step"):
                values = [x[f"mem_{phase}_gib"] for x in steps if x.get(f"mem_{phase}_gib") is not None]
                r[f"mem_{phase}_gib"] = max(values) if values else None


def plan_comparison(cfg, summary: dict) -> None:
    """`sparkrl plan`'s figures for the two phases a GPU goes through, and the measured peaks over them."""
    from rl.plan import RUNTIME_BYTES, make_plan

    p = make_plan(cfg, advise=False)
    during_rollout = p.r_budget + (p.t_resident if p.placement == "colocated" else 0.0)
    during_train = p.t_peak + (RUNTIME_BYTES if p.placement == "colocated" else 0.0)
    summary["plan_rollout_gib"] = during_rollout / GiB
    summary["plan_train_gib"] = during_train / GiB
    if summary.get("mem_rollout_gib") is not None:
        summary["rollout_vs_plan"] = summary["mem_rollout_gib"] / summary["plan_rollout_gib"]
    trained = [summary.get(f"mem_{k}_gib") for k in ("logprob", "train")]
    trained = [x for x in trained if x is not None]
    if trained:
        summary["train_vs_plan"] = max(trained) / summary["plan_train_gib"]


def next_step_fits(elapsed_s: float, step_s: list[float], budget_s: float) -> bool:
    """Whether one more step, as long as the longest so far, ends within `budget_s` (0: no budget; the
    first step always runs)."""
    return not budget_s or not step_s or elapsed_s + max(step_s) <= budget_s


def run_steps(cfg, peak_tflops: float = 0.0, budget_s: float = 0.0) -> list[dict]:
    """`trainer.total_steps` steps of `cfg` into a run directory of their own (fewer where the next would
    end past `budget_s` seconds from the start); the rows of its metrics, with each phase's peak device
    memory on GPUs and, with `peak_tflops`, MFU."""
    from rl.config import run_dir
    from rl.driver import Run

    cfg.run.name = f"{cfg.run.name}-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    # run.dir, when given, is the folder the bench's run directories go in (e.g. under $OUT)
    cfg.run.dir = str(Path(cfg.run.dir) / cfg.run.name) if cfg.run.dir else ""
    cfg.trainer.checkpoint_every = 0
    memory = DeviceMemory.on_gpus() if cfg.resources.num_gpus else None
    starts: dict[int, float] = {}
    began, took = time.perf_counter(), []
    run = Run(cfg)
    try:
        with memory or contextlib.nullcontext():
            for step in range(1, cfg.trainer.total_steps + 1):
                if not next_step_fits(time.perf_counter() - began, took, budget_s):
                    print(
                        f"bench.grpo: stopped before step {step}: it would end past --budget-s {budget_s:g}"
                    )
                    break
                run.step = step
                starts[step] = time.perf_counter()
                run.log.log(step, run.train_step(step))
                took.append(time.perf_counter() - starts[step])
    finally:
        run.log.close()
        run.close()
    rows = rows_from_metrics(run_dir(cfg) / "metrics.jsonl")
    summary = rows[-1]
    if memory is not None:
        add_phase_memory(rows, memory.samples, starts)
        plan_comparison(cfg, summary)
    if peak_tflops and summary.get("train_tokens_per_s"):
        from bench.trainer import active_params
        from rl.setup import resolve_model_paths

        _, active = active_params(resolve_model_paths(cfg)[0])
        summary["active_params"] = active
        summary["mfu_6n"] = (
            6 * active * summary["train_tokens_per_s"] / (peak_tflops * 1e12 * cfg.trainer.num_ranks)
        )
    return rows


def measure(s, args) -> list[dict]:
    from rl.config import load_config

    if not args.max_staleness:
        return run_steps(s.cfg, args.peak_tflops, args.budget_s)
    rows, first = [], None
    for k in args.max_staleness:
        # load_config validates each value as `sparkrl train` would (colocated GPU placement refuses k > 0)
        cfg = load_config(args.recipe, [*args.overrides, f"rollout.max_staleness={k}"])
        cfg.run.name = f"{cfg.run.name}-k{k}"
        run_rows = [{"max_staleness": k, **r} for r in run_steps(cfg, args.peak_tflops, args.budget_s)]
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
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop before a step that would end past this many seconds from the run's start (0: none)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the GPU's bf16 matmul rate (TFLOP/s), for MFU (0: no MFU)",
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
        "logprob_s",
        "train_s",
        "sync_s",
        "sync_share",
        "rollout_tokens_per_s",
        "train_tokens_per_s",
        "mfu_6n",
        "mem_rollout_gib",
        "mem_train_gib",
        "mem_sync_gib",
        "plan_rollout_gib",
        "plan_train_gib",
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
