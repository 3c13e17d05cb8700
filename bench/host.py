"""The trainer side of the benchmarks, in a process of its own (`TrainerHost`, a one-worker spawn pool).

Why a separate process: the driver must not initialise CUDA, or vLLM has to spawn (not fork) each engine
process, and the trainers then share a process with nothing that could hold their memory. Here several
`trainer.worker.TrainerWorker`s (one torch.distributed rank each, world size 1) live side by side under
names; the driver calls the functions below through `TrainerHost.call`, and what they return is pickled
back (the adapter's tensors included: a copy like the Ray object transfer of the real system).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

_TRAINERS: dict = {}


class TrainerHost:
    def __init__(self):
        import multiprocessing as mp

        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))

    def call(self, fn: str, *args, **kwargs):
        return self.pool.submit(_dispatch, fn, args, kwargs).result()

    def close(self) -> None:
        try:
            self.call("shutdown")
        except Exception:  # noqa: BLE001 - a dead host has nothing left to shut down
            pass
        self.pool.shutdown(wait=True, cancel_futures=True)


def _dispatch(fn: str, args, kwargs):
    return globals()[fn](*args, **kwargs)


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------
# Called from the driver.


def device_info() -> dict:
    if not torch.cuda.is_available():
        return {"device": "cpu", "torch_threads": torch.get_num_threads()}
    p = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "sms": p.multi_processor_count,
        "torch_cuda": torch.version.cuda,
    }


def build_models(specs, root) -> list[dict]:
    from bench.models import build

    out = [build(s, root, log=lambda m: print(m, flush=True)) for s in specs]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def matmul_rate(n: int = 8192, iters: int = 20) -> dict:
    """The bf16 dense matmul rate this device reaches (the MFU denominator): n^3 GEMMs, median of iters.
    CPU (--tiny): float32 and small n, only so that the code path runs."""
    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        a @ b
        _sync()
        times.append(time.perf_counter() - t)
    s = float(np.median(times))
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "iters": iters,
        "median_s": s,
        "tflops": 2 * n**3 / s / 1e12,
    }


def create_trainer(name: str, spec) -> dict:
    """A TrainerWorker on `spec` under `name`; world size 1 (the process group is made once)."""
    from trainer.group import free_port
    from trainer.worker import TrainerWorker

    t = time.perf_counter()
    _TRAINERS[name] = TrainerWorker(0, 1, "127.0.0.1", free_port(), spec)
    n_lora = sum(p.numel() for p in _TRAINERS[name].params)
    return {"load_s": time.perf_counter() - t, "lora_params": int(n_lora)}


def drop_trainer(name: str) -> None:
    _TRAINERS.pop(name, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def perturb_lora_b(name: str, std: float, seed: int) -> None:
    """Draw every lora_B at random (PEFT starts it at 0: the adapter would be the identity), so that the
    adapter the benchmarks load changes log-probs and the KL rows cover it."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for n, p in _TRAINERS[name].model.named_parameters():
            if p.requires_grad and ".lora_B." in n:
                local = p.to_local() if isinstance(p, DTensor) else p  # world size 1: the whole tensor
                local.copy_(torch.randn(local.shape, generator=g) * std)


def export_adapter(name: str, dtype: str | None = None):
    """(tensors, adapter_config, seconds inside the trainer); `dtype` as the driver's sync asks for it."""
    t = time.perf_counter()
    tensors, config = _TRAINERS[name].export_adapter(dtype)
    return tensors, config, time.perf_counter() - t


def log_probs(name: str, samples):
    """(per-sample response log-probs, the worker's metrics, seconds)."""
    _sync()
    t = time.perf_counter()
    out, metrics = _TRAINERS[name].log_probs(samples)
    _sync()
    return out, metrics, time.perf_counter() - t


def profile_device(fn) -> dict:
    """fn() once under torch.profiler: where the device time goes (top ops by self device time) and how
    busy the device was (kernel time / wall time), to tell matmul-bound from overhead-bound."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        _sync()
    wall = time.perf_counter() - t
    events = prof.key_averages()
    if not torch.cuda.is_available():
        device = "self_cpu_time_total"  # CPU: the "device" is the CPU itself
        kernels, ops = events, events
    else:
        device = (
            "self_device_time_total"
            if hasattr(events[0], "self_device_time_total")
            else "self_cuda_time_total"
        )
        # Kernels and copies are device-side events; each op (aten::mul, ...) also carries its kernels' time:
        # busy time sums the first, the table ranks the second (summing both would count twice).
        on_device = {str(e.device_type) for e in events} - {"DeviceType.CPU"}
        kernels = [e for e in events if str(e.device_type) in on_device]
        ops = [e for e in events if str(e.device_type) == "DeviceType.CPU"]
    busy_us = sum(getattr(e, device, 0) for e in kernels)
    top = sorted(ops, key=lambda e: getattr(e, device, 0), reverse=True)[:20]
    # Where the host's time goes when the device waits: ops by their own CPU time (dispatch, guards, hooks
    # show as the ops they run; what is left of the wall time is Python between ops).
    host = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "wall_s": wall,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "device_busy_s": busy_us / 1e6,
        "device_busy_fraction": busy_us / 1e6 / wall if wall else None,
        "host_ops_s": sum(e.self_cpu_time_total for e in ops) / 1e6,
        "top_host_ops": [
            {"name": e.key[:120], "calls": e.count, "cpu_ms": e.self_cpu_time_total / 1e3} for e in host
        ],
        "top_ops": [
            {
                "name": e.key[:120],
                "calls": e.count,
                "device_ms": getattr(e, device, 0) / 1e3,
                "cpu_ms": e.self_cpu_time_total / 1e3,
            }
            for e in top
        ],
    }


REPO = Path(__file__).resolve().parents[1]


def sync_site(stack: list[traceback.FrameSummary], root: Path = REPO) -> str:
    """Where a synchronizing call came from: the innermost frame, then the innermost three of this
    repository's frames ("path:line" relative to it), innermost first."""

    def name(f: traceback.FrameSummary) -> str:
        path = Path(f.filename)
        return f"{path.relative_to(root) if path.is_relative_to(root) else path.name}:{f.lineno}"

    ours = [f for f in stack if Path(f.filename).is_relative_to(root)]
    sites = [stack[-1]] + [f for f in reversed(ours[-3:]) if f is not stack[-1]]
    return " < ".join(name(f) for f in sites)


def sync_sites(fn, top: int = 12) -> list[dict]:
    """fn() once with CUDA's sync debug mode on: every operation that makes the host wait for the device (an
    `.item()`, a copy to or from pageable host memory, ...) warns, and the warnings' call sites are counted.
    The device idles after each such wait until the host has queued new work: in a host-bound step these
    are the first places to look. Empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    counts: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            stack = traceback.extract_stack()[:-1]
            while stack and stack[-1].filename == warnings.__file__:  # the warnings module's own frames
                stack.pop()
            counts[sync_site(stack)] += 1

    _sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [{"site": site, "calls": n} for site, n in counts.most_common(top)]


def train_bench(name: str, samples, warmup: int, steps: int, profile: bool = False) -> dict:
    """Time log_probs (forward) and train_step (forward + backward + AdamW) on one fixed batch."""
    w = _TRAINERS[name]
    rng = np.random.default_rng(0)
    adv = rng.normal(size=len(samples)).tolist()
    for _ in range(warmup):
        w.train_step(samples, adv)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    fwd, step = [], []
    for _ in range(steps):
        _sync()
        t = time.perf_counter()
        old, _ = w.log_probs(samples)
        _sync()
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        metrics = w.train_step(samples, adv, old)
        _sync()
        step.append(time.perf_counter() - t)
    out = {
        "log_probs_s": float(np.median(fwd)),
        "train_step_s": float(np.median(step)),
        "train_step_s_all": step,
        "grad_norm": metrics.get("actor/grad_norm"),
    }
    if torch.cuda.is_available():
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if profile:
        out["profile"] = profile_device(lambda: w.train_step(samples, adv, old))
        # The forward alone ran at a third of the train step's MFU on the H200 (fifth session): its own
        # profile says whether the device or the host paces it.
        out["profile_log_probs"] = profile_device(lambda: w.log_probs(samples))
        out["sync_sites"] = sync_sites(lambda: w.train_step(samples, adv, old))
        out["sync_sites_log_probs"] = sync_sites(lambda: w.log_probs(samples))
    return out


def shutdown() -> None:
    import torch.distributed as dist

    _TRAINERS.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def pid() -> int:
    return os.getpid()
