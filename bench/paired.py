"""Rollout throughput of two engines measured in alternation: the R3 cost as a paired figure.

One engine per process, as everywhere in bench/, but here both stay up at once, each in its own child
process, and every timed batch runs on both, back to back, on the same prompts and seeds (which engine goes
first alternates). Measured one after the other (bench/rollout.py), repeats of one batch size differed by up
to 2.5x on the H200 while the R3 budget is 3 %: whatever slowed the machine for a while slowed only one
engine's rows. Paired, a slow spell hits both runs of a pair; the figure is 1 - tok/s(other) / tok/s(base)
from the per-pair ratios, balanced over the two orders (`paired_cost`).

The children take their orders through a pipe: ("run", prompts, output_len, seed) -> (seconds, tokens,
CPU seconds, stolen seconds). The CPU seconds are those of the engine's whole process tree (the child and
vLLM's engine-core process) during the run: the same work costing more CPU time in one engine says its host
ran slower (clock, cache, memory placement); the same CPU time over a longer run says it waited (for the
device, or for a core). The stolen seconds are the whole machine's (a virtual machine's cores lent to other
guests).

Before each run, with both engines idle, the parent times a fixed piece of Python work (the host probe,
bench/pairstats.py): a run's host speed is the mean of the probes before and after it, and each pair's
probe ratio goes on the row (`paired_probe_log_ratios`) for `pooled_cost(adjust=True)`.

`BENCH_PIN_CPUS` pins both engines' processes to one set of cores before they start: "local" for the cores
on the GPU's NUMA node (from sysfs), or a list such as "0-7,16". Unset: wherever the OS puts them.

`--pair-concurrent` (the two-GPU machine) runs the two engines at the same time instead, each on its own GPU
(the first engine of the pair on the first visible GPU): a pair's two runs then share whatever the host is
doing during them, where runs in alternation, seconds apart, differed by ~10 % with nothing between them
(the eighth to tenth sessions). Which GPU an engine has takes the place of which engine started first:
a second call with the pair listed the other way round balances it (`pooled_cost` pools the calls).

`--rollout-profile` adds, after the timed sweep, one batch of the largest size on each engine under vLLM's
torch profiler, which runs in the engine's own process: its table of device time per op (kept in
$OUT/profile_<engine>/) gives each engine's device seconds for the same work, which tells a cost on the
device (kernels R3 adds or slows) from one on the host (the device idle for longer).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench import engines
from bench.common import log, out_dir
from bench.pairstats import host_probe_seconds, paired_cost, run_probes
from bench.rollout import REPEATS, WARMUP_TOKENS, _prompts, rollout_row, timed_generate

START_TIMEOUT_S = 600
SETTLE_S = 0.5  # between timed runs: the engine that just ran finishes its own clean-up first


def profile_dir(key: str) -> Path:
    return out_dir() / f"profile_{key}"


_TOTAL = re.compile(r"^Self (CPU|CUDA) time total: ([0-9.]+)(us|ms|s)\s*$", re.MULTILINE)
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def profile_totals(table: str) -> dict[str, float]:
    """The footer of torch's `key_averages().table()`: {"host_ops_s": self CPU time of the recorded ops,
    "device_s": self CUDA time of the kernels} (the latter absent without CUDA)."""
    names = {"CPU": "host_ops_s", "CUDA": "device_s"}
    return {names[kind]: float(value) * _UNIT_S[unit] for kind, value, unit in _TOTAL.findall(table)}


_UNIT = re.compile(r"^([0-9.]+)(us|ms|s)$")


def host_ops(table: str) -> dict[str, list]:
    """{op name: [own CPU seconds, calls]} of the rows of torch's `key_averages().table()` (columns split
    by two or more spaces: name, self CPU %, self CPU, ..., # of calls). vLLM's per-step ranges
    (`execute_context_...`, named after the step's batch) are not ops and are left out."""
    out = {}
    for line in table.splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) < 4 or not cols[-1].isdigit() or (m := _UNIT.match(cols[2])) is None:
            continue
        if cols[0].startswith("execute_context"):
            continue
        out[cols[0]] = [float(m[1]) * _UNIT_S[m[2]], int(cols[-1])]
    return out


def host_ops_delta(base: dict[str, list], other: dict[str, list]) -> tuple[float, float | None]:
    """Two engines' profiled host ops (`host_ops`) on the same batch: (the own CPU seconds of the calls that
    `other` made beyond `base`, at `other`'s cost per call; the median ratio of the cost per call of the ops
    both called equally often, over those of 1 ms or more). The first is what the other engine's feature
    adds; the second how much slower the same host work ran in the other engine's process (1.0: as fast)."""
    added, ratios = 0.0, []
    for name, (seconds, calls) in other.items():
        base_s, base_calls = base.get(name, (0.0, 0))
        if calls > base_calls:
            added += (calls - base_calls) * seconds / calls
        elif calls == base_calls and base_s >= 1e-3:
            ratios.append(seconds / base_s)
    return added, (float(np.median(ratios)) if ratios else None)


def parse_cpu_list(text: str) -> set[int]:
    """sysfs's and taskset's core lists ("0-7,16,18-19") as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus) -> str:
    """The inverse of `parse_cpu_list`: sorted, runs joined ("0-3,8")."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def gpu_local_cpus() -> set[int] | None:
    """The cores on the NUMA node of the first visible GPU (sysfs `local_cpulist` of its PCI device), or None
    when unknown. The bus id comes from nvidia-smi, not CUDA: CUDA initialised in this process would force
    vLLM to spawn its engine process."""
    import subprocess

    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        bus = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", first],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        # nvidia-smi says 00000000:19:00.0, sysfs 0000:19:00.0 (lower case)
        domain, rest = bus.split(":", 1)
        return parse_cpu_list(
            (Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}".lower() / "local_cpulist").read_text()
        )
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def pin_cpus(spec: str | None) -> set[int] | None:
    """Pin this process (and what it starts later) to the cores `spec` names (BENCH_PIN_CPUS), within the
    ones it may use; the set pinned to, or None when `spec` is empty. An empty intersection is an error."""
    if not spec:
        return None
    allowed = os.sched_getaffinity(0)
    wanted = gpu_local_cpus() if spec == "local" else parse_cpu_list(spec)
    if wanted is None:
        raise RuntimeError(
            "BENCH_PIN_CPUS=local: the GPU's NUMA node is not known here (no nvidia-smi, or no sysfs entry)"
        )
    cpus = wanted & allowed
    if not cpus:
        raise ValueError(
            f"BENCH_PIN_CPUS={spec}: none of cores {format_cpu_list(wanted)} is allowed here "
            f"(allowed: {format_cpu_list(allowed)})"
        )
    os.sched_setaffinity(0, cpus)
    return cpus


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process and its living descendants so far (vLLM's engine-core process
    is a child of the one that opened the engine)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:  # ended between the listing and the reading
            continue
        total += t.user + t.system
    return total


def steal_seconds() -> float:
    """CPU seconds the hypervisor gave to others so far, over all cores (0 where the kernel does not say)."""
    import psutil

    return float(getattr(psutil.cpu_times(), "steal", 0.0))


# One timed batch: (seconds, tokens, the engine's CPU seconds, the machine's stolen CPU seconds, its start as
# time.time(), comparable between the processes)
Run = tuple[float, int, float, float, float]


def _cpu_timed_generate(worker, prompts, output_len: int, seed: int | None) -> Run:
    cpu, steal, started = tree_cpu_seconds(), steal_seconds(), time.time()
    seconds, tokens = timed_generate(worker, prompts, output_len, seed)
    return seconds, tokens, tree_cpu_seconds() - cpu, steal_seconds() - steal, started


def overlap_fraction(a: Run, b: Run) -> float:
    """How much of the longer of two runs the other ran beside it: 1 for runs at once, 0 for runs in turn."""
    start, end = max(a[4], b[4]), min(a[4] + a[0], b[4] + b[0])
    return max(0.0, end - start) / max(a[0], b[0])


def _profiled_generate(worker, key: str, prompts, output_len: int, seed: int) -> dict:
    """One batch under vLLM's profiler; (seconds, tokens) of it, the table's totals and its first rows."""
    table_file = profile_dir(key) / "profiler_out_0.txt"
    table_file.unlink(missing_ok=True)
    worker.llm.start_profile()
    try:
        seconds, tokens = timed_generate(worker, prompts, output_len, seed)
    finally:
        worker.llm.stop_profile()  # writes the table and the trace before it returns
    table = table_file.read_text() if table_file.exists() else ""
    rows = [line for line in table.splitlines() if line.strip() and not line.startswith("-")]
    return {
        "seconds": seconds,
        "tokens": tokens,
        **profile_totals(table),
        "top_ops": rows[1:9],
        "host_ops": host_ops(table),
    }


def _child(conn, key: str, model: dict, args, adapter_dir: str | None) -> None:
    """An engine's process: open it, load the adapter, then time generate calls until told to stop."""
    from rollout.staging import default_stage_root

    worker = None
    try:
        cfg, note = engines.CONFIGS[key], ""
        if args.tiny:
            cfg, note = engines.on_cpu_plan(cfg)
            if cfg is None:
                raise RuntimeError(f"--tiny: engine {key} cannot run on CPU ({note})")
        profiling = str(profile_dir(key)) if args.rollout_profile else None
        pinned = pin_cpus(os.environ.get("BENCH_PIN_CPUS"))
        worker, info = engines.open_engine(cfg, model, args, default_stage_root(f"pair_{key}"), profiling)
        info["note"] = note
        info["cpus"] = format_cpu_list(os.sched_getaffinity(0))
        info["pinned"] = pinned is not None
        info["gpu"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cfg.lora and adapter_dir:
            worker.load_adapter(adapter_dir, None, version=1)
        conn.send(("up", info))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            kind, prompts, output_len, seed = msg
            seed = seed if cfg.request_seeds else None  # rollout.seed_scope "engine"
            if kind == "profile":
                conn.send(("ok", _profiled_generate(worker, key, prompts, output_len, seed)))
            else:
                conn.send(("ok", _cpu_timed_generate(worker, prompts, output_len, seed)))
    except Exception as e:  # noqa: BLE001 - the parent records it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
    finally:
        if worker is not None:
            worker.shutdown()
        conn.close()


def visible_gpu(i: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of the i-th GPU this process sees (the parent's own list, if it has one)."""
    seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if seen and i >= len(seen):
        raise RuntimeError(f"--pair-concurrent needs GPU {i}, but CUDA_VISIBLE_DEVICES lists {len(seen)}")
    return seen[i] if seen else str(i)


def pair_gpus(concurrent: bool, tiny: bool) -> list[str | None]:
    """Each engine's GPU: its own when they run at the same time on the GPU machine; None (the process's
    own devices) in alternation, or on the CPU machine."""
    if not concurrent or tiny:
        return [None, None]
    import torch

    if torch.cuda.device_count() < 2:
        raise RuntimeError(
            f"--pair-concurrent runs each engine on its own GPU: this machine shows {torch.cuda.device_count()}"
            " (use the two-GPU machine, or drop the option to run them in alternation)"
        )
    return [visible_gpu(0), visible_gpu(1)]


class _Engine:
    def __init__(self, key: str, model: dict, args, adapter_dir: str | None, gpu: str | None = None):
        self.key = key
        ctx = mp.get_context("spawn")  # vLLM and CUDA need a fresh interpreter
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, key, model, args, adapter_dir), daemon=False)
        # A spawned child starts with the parent's environment as it is at start(): its one GPU, set here,
        # is all that CUDA and vLLM in it will see.
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        try:
            self.proc.start()
        finally:
            if gpu is not None:
                if saved is None:
                    del os.environ["CUDA_VISIBLE_DEVICES"]
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
        child.close()

    def wait_up(self) -> dict:
        return self._reply(START_TIMEOUT_S)

    def start(self, prompts, output_len: int, seed: int) -> None:
        self.conn.send(("run", prompts, output_len, seed))

    def result(self) -> Run:
        return self._reply(START_TIMEOUT_S)

    def run(self, prompts, output_len: int, seed: int) -> Run:
        self.start(prompts, output_len, seed)
        return self.result()

    def profile(self, prompts, output_len: int, seed: int) -> dict:
        self.conn.send(("profile", prompts, output_len, seed))
        return self._reply(START_TIMEOUT_S)

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine {self.key}: no reply in {timeout:.0f}s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine {self.key}: {payload}")
        return payload

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(120)
        if self.proc.is_alive():
            self.proc.kill()


def cpu_figures(runs: list[Run]) -> dict:
    """An engine's CPU figures from its timed runs (`Run`): the median CPU seconds a run, the median CPU
    seconds per wall second (cores kept busy; above 1, threads in parallel), and the machine's stolen CPU
    seconds in each run (a virtual machine's cores given to other guests: where the slow runs have them, the
    drift is the host's neighbours)."""
    return {
        "cpu_s": float(np.median([r[2] for r in runs])),
        "cpu_s_all": [round(r[2], 3) for r in runs],
        "steal_s": float(np.median([r[3] for r in runs])),
        "steal_s_all": [round(r[3], 3) for r in runs],
        "cpu_per_wall": float(np.median([r[2] / r[0] for r in runs])),
    }


def _profile_rows(pair: list[_Engine], args, vocab: int) -> Iterator[dict]:
    """One profiled batch of the largest size per engine, same prompts and seed; rows for
    rollout_profile.json (marked with `bench`)."""
    b = max(args.batch_sizes)
    prompts = _prompts(b, args.prompt_len, vocab, seed=b + 999_000)
    for e in pair:
        p = e.profile(prompts, args.output_len, 7)
        steps = args.output_len  # decode steps (the prefill is one more)
        row = {
            "bench": "rollout_profile",
            "config": e.key,
            "batch": b,
            "output_len": args.output_len,
            "seconds": p["seconds"],
            "tokens_per_s": p["tokens"] / p["seconds"],
            "host_ops_s": p.get("host_ops_s"),
            "device_s": p.get("device_s"),
            "device_ms_per_step": 1000 * p["device_s"] / steps if "device_s" in p else None,
            "device_busy": p["device_s"] / p["seconds"] if "device_s" in p else None,
            "top_ops": p["top_ops"],
            "host_ops": p["host_ops"],
            "profile_dir": str(profile_dir(e.key)),
        }
        busy = f", device {row['device_s']:.3f}s ({row['device_busy']:.0%} busy)" if row["device_s"] else ""
        log(f"    profiled batch {b}: {e.key} {row['seconds']:.3f}s, {row['tokens_per_s']:.0f} tok/s{busy}")
        yield row


def sweep_pair(
    base_key: str,
    other_key: str,
    model: dict,
    args,
    adapter: tuple[dict, dict] | None,
    repeats: int = REPEATS + REPEATS % 2,  # even: as many pairs in each order (run_all: --pair-repeats)
) -> Iterator[dict]:
    """Rows in bench/rollout.py's format for both engines (their own medians), plus, on the other engine's
    rows, `paired_cost` (its cost relative to the base engine) and the per-pair figures; yielded per batch
    size, as measured."""
    from trainer.checkpoint_io import write_adapter

    vocab = model["config"]["vocab_size"]
    concurrent = bool(getattr(args, "pair_concurrent", False))
    gpus = pair_gpus(concurrent, args.tiny)
    with tempfile.TemporaryDirectory(prefix="sparkrl_pair_") as tmp:
        adapter_dir = str(write_adapter(Path(tmp) / "adapter", *adapter)) if adapter else None
        pair: list[_Engine] = []
        try:
            infos = {}
            # One after the other: vLLM sizes its KV cache from the memory that changed on the GPU while it
            # profiled, so an engine starting beside another one would count the other's allocations.
            for key, gpu in zip((base_key, other_key), gpus):
                t = time.time()
                pair.append(_Engine(key, model, args, adapter_dir, gpu))
                infos[key] = pair[-1].wait_up()
                log(f"  engine {key} up ({infos[key].get('graphs')}; {time.time() - t:.0f}s)")
            for b in args.batch_sizes:  # kernel compilation and autotuning at new shapes, untimed
                for e in pair:
                    e.run(_prompts(b, args.prompt_len, vocab, seed=10_000 + b), WARMUP_TOKENS, 0)
            for b in args.batch_sizes:
                runs: dict[str, list[Run]] = {e.key: [] for e in pair}
                order, quiet = [], []  # which engine ran each run, and the host probe before it (time order)
                for r in range(repeats):
                    prompts = _prompts(b, args.prompt_len, vocab, seed=b + 1000 * r)
                    if concurrent:  # both at once: one probe before the pair, shared by its two runs
                        time.sleep(SETTLE_S)
                        quiet.append(host_probe_seconds())
                        for e in pair:
                            e.start(prompts, args.output_len, 1 + r)
                        for e in pair:
                            runs[e.key].append(e.result())
                        continue
                    for e in pair if r % 2 == 0 else pair[::-1]:
                        time.sleep(SETTLE_S)
                        quiet.append(host_probe_seconds())
                        order.append(e.key)
                        runs[e.key].append(e.run(prompts, args.output_len, 1 + r))
                time.sleep(SETTLE_S)
                quiet.append(host_probe_seconds())
                if concurrent:
                    probes = {e.key: run_probes(quiet) for e in pair}
                else:
                    probes = {
                        e.key: [p for k, p in zip(order, run_probes(quiet)) if k == e.key] for e in pair
                    }
                rows = {
                    e.key: {
                        **infos[e.key],
                        "config": e.key,
                        **rollout_row(b, args.prompt_len, args.output_len, [r[:2] for r in runs[e.key]]),
                        **cpu_figures(runs[e.key]),
                        "probe_ms": 1000 * float(np.median(probes[e.key])),
                        "probe_ms_all": [round(1000 * p, 3) for p in probes[e.key]],
                        "paired_with": other_key if e.key == base_key else base_key,
                        "paired_mode": "concurrent" if concurrent else "alternating",
                    }
                    for e in pair
                }
                base_rates, other_rates = ([t / s for s, t, *_ in runs[k]] for k in (base_key, other_key))
                per_pair = [round(1 - o / x, 4) for x, o in zip(base_rates, other_rates)]
                cost = paired_cost(base_rates, other_rates)
                probe_logs = [
                    round(float(np.log(o / x)), 5) for x, o in zip(probes[base_key], probes[other_key])
                ]
                rows[other_key].update(
                    paired_cost=cost,
                    paired_costs_all=per_pair,
                    paired_probe_log_ratios=probe_logs,
                    # 1 where the pair's runs went at once, 0 in turn: what the mode claims, measured
                    paired_overlap_all=[
                        round(overlap_fraction(x, o), 3) for x, o in zip(runs[base_key], runs[other_key])
                    ],
                )
                log(
                    f"    batch {b:4d}: {base_key} {rows[base_key]['tokens_per_s']:9.1f} tok/s, {other_key} "
                    f"{rows[other_key]['tokens_per_s']:9.1f} tok/s; paired cost {cost:.1%} "
                    f"({', '.join(f'{x:.1%}' for x in per_pair)}); CPU s a run "
                    f"{rows[base_key]['cpu_s']:.2f} / {rows[other_key]['cpu_s']:.2f}, CPU per wall second "
                    f"{rows[base_key]['cpu_per_wall']:.2f} / {rows[other_key]['cpu_per_wall']:.2f}, host probe ms "
                    f"{rows[base_key]['probe_ms']:.2f} / {rows[other_key]['probe_ms']:.2f}"
                )
                yield from rows.values()
            if args.rollout_profile:
                yield from _profile_rows(pair, args, vocab)
        finally:
            for e in pair:
                e.close()
