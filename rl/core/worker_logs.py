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
import re
import sys
from pathlib import Path

LOG_DIR_ENV = "SPARKRL_LOG_DIR"

# The first line a native crash writes: glibc's heap checks (malloc(): ..., free(): ..., double free or
# corruption, corrupted size ...), Ray's handler of a fatal signal (the native stack, before it passes the
# signal on), faulthandler's report, tests/stress/quarantine_malloc.c's.
_CRASH_LINE = re.compile(
    r"^(Fatal Python error|malloc(_consolidate)?\(\)|free\(\)|realloc\(\)|munmap_chunk\(\)|double free"
    r"|corrupted |\*\*\* SIG[A-Z]+ received|=== quarantine_malloc)"
)


def log_dir() -> Path | None:
    value = os.environ.get(LOG_DIR_ENV)
    return Path(value) if value else None


def capture(role: str) -> Path | None:
    """Redirect this process's stdout and stderr to `<log dir>/<role>.log` (appended); None, and the output
    left where it was, when no log directory is set (tests that build workers directly, plain library use,
    a run on a Ray instance already started). Either way faulthandler writes a native crash's stacks there."""
    directory = log_dir()
    if directory is None:
        # A native crash (SIGSEGV, SIGABRT) prints the Python stack of every thread where fd 2 goes (where
        # faulthandler is on already, as pytest turns it on, it stays as it is).
        if not faulthandler.is_enabled():
            faulthandler.enable(file=sys.__stderr__, all_threads=True)
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{role}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # into the same file, now
    print(f"{_SECTION}{role} (pid {os.getpid()}{_node()}) ---", flush=True)
    return path


_SECTION = "--- "  # the line each process's capture() starts its part of a role's file with


def stderr_path() -> str | None:
    """The file this process's stderr (fd 2) writes to: its role's log, or Ray's own log of the worker
    (`worker-<id>-<pid>.err`). None for a terminal or a pipe."""
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return target if target.startswith("/") and Path(target).is_file() else None


def crash_report(path: Path, max_lines: int = 120) -> str | None:
    """What a native crash left at the end of a worker's log: from the first line glibc's heap checks or
    faulthandler write (the abort's reason, then every thread's Python stack) to the end, at most max_lines,
    in the part of the file the last process wrote. None when the file is missing or that process wrote no
    such line (it was killed, or is alive)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith(_SECTION)]
    last = lines[starts[-1] + 1 :] if starts else lines
    first = next((i for i, line in enumerate(last) if _CRASH_LINE.match(line)), None)
    if first is None:
        return None
    report = last[first : first + max_lines]
    more = len(last) - first - len(report)
    return "\n".join(report + ([f"... {more} more lines in {path}"] if more > 0 else []))


def _node() -> str:
    """`, node <address>` as Ray reports it, in a Ray worker: which machine a log came from."""
    import ray

    return f", node {ray.util.get_node_ip_address()}" if ray.is_initialized() else ""
