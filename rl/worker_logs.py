"""Each worker's own output (vLLM's engine lines, torch and PEFT warnings, native crash reports) goes to a
file of the run, `<run>/logs/<role>.log`, instead of the driver's terminal.

The driver sets `LOG_DIR_ENV` in the job's runtime environment (rl/setup.py `init_ray`) and starts Ray with
`log_to_driver=False`; every worker actor calls `capture(role)` first thing in its constructor. The file
descriptors 1 and 2 themselves are redirected (not only `sys.stdout`), so vLLM's engine-core process
(on GPU; a CPU engine runs in the worker's own process), which the rollout worker spawns after this call
and which inherits them, writes there too, and so does a native abort (glibc, faulthandler) that never
reaches Python's streams.

A directory that another node cannot see is no loss: each node's workers write under the same path on
their own node.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

LOG_DIR_ENV = "SPARKRL_LOG_DIR"


def log_dir() -> Path | None:
    value = os.environ.get(LOG_DIR_ENV)
    return Path(value) if value else None


def capture(role: str) -> Path | None:
    """Redirect this process's stdout and stderr to `<log dir>/<role>.log` (appended); None, and nothing
    changed, when no log directory is set (tests that build workers directly, plain library use)."""
    directory = log_dir()
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{role}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A native crash (SIGSEGV, SIGABRT) prints the Python stack of every thread into the same file.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    print(f"--- {role} (pid {os.getpid()}{_node()}) ---", flush=True)
    return path


def _node() -> str:
    """`, node <address>` as Ray reports it, in a Ray worker: which machine a log came from."""
    import ray

    return f", node {ray.util.get_node_ip_address()}" if ray.is_initialized() else ""
