"""The CPU trainer's process group: gloo with one worker thread.

ProcessGroupGloo runs each collective on one of a pool of worker threads (torch starts 2), all over one gloo
context and one connection to each peer. With two, a rank's heap was corrupted now and then inside gloo, on
the 2-core machine (torch 2.13):
- a CPU training run's rank 0 died at step 226 in the merged export, `malloc(): unaligned tcache chunk
  detected` on a worker thread inside gloo's all-gather (tests/stress/long_runs.sh);
- tests/stress/gather_stress.py, two ranks gathering DTensor shards one all-gather at a time with no trainer,
  died after about 535,000 gathers (SIGSEGV in malloc on gloo's transport thread) and after about 280,000
  (`free(): invalid pointer` in gloo's UnboundBuffer destructor on a worker thread), and a third run passed
  350,000: two crashes in about 1.17 million gathers;
each time in gloo's own code, on a corrupted 32-byte chunk. With one worker thread, no crash:
- the same stress: 2,767,872 gathers in 15 runs (three of 20 to 22 minutes, two of 400 s, then ten of 50 s in
  a row), where the two-thread rate expects 4.7 crashes (p about 0.01 of none by chance);
- `tests/stress/long_runs.sh 100 150`: 29 training runs in a row, two at a time (12 demo-shaped, 17
  e2e-shaped; 27 of 150 steps, the last of each shape stopped at the time limit), 4,142 trainer steps in
  all, each with its merged export, where the two-thread rate (one crash in about 3,500) expects 1.2.
A rank issues its collectives one at a time on CPU (FSDP2's are synchronous there, and DTensor waits on each
gather), so the second thread overlapped nothing.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def backend_with_threads(threads: int) -> str:
    """The name of a backend that is ProcessGroupGloo with `threads` worker threads, registered on first use
    (for `init_process_group`)."""
    name = f"gloo_threads{threads}"
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, _gloo_with_threads(threads), devices=["cpu"])
    return name


def _gloo_with_threads(threads: int):
    """A `Backend.register_backend` creator: ProcessGroupGloo on the default device with `threads` workers."""

    def create(store, rank: int, size: int, timeout: datetime.timedelta):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._threads = threads
        return dist.ProcessGroupGloo(store, rank, size, options)

    return create


def worker_threads() -> int:
    """The default process group's ProcessGroupGloo worker threads."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._threads


def cpu_backend() -> str:
    """The backend name to give `init_process_group` for CPU ranks: gloo with one worker thread."""
    return backend_with_threads(1)
