"""What every benchmark shares: timestamped logging, JSON results written after every row, the time
budget, the environment record, the vLLM plugin, and opening an engine with a fallback.

Nothing here touches CUDA: the driver process stays CUDA-free so that vLLM can fork its engine processes
(fast) and so that an engine's memory is freed when its process exits.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.time()
_LOG_FILE: Path | None = None


def log(msg: str) -> None:
    """`[UTC time +seconds since start] msg` to stdout and $OUT/log.txt (flushed: a killed run keeps it)."""
    now = dt.datetime.now(dt.UTC).strftime("%H:%M:%S")
    line = f"[{now} +{time.time() - START:7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG_FILE is not None:
        with _LOG_FILE.open("a") as f:
            f.write(line + "\n")


def set_log_file(path: Path) -> None:
    global _LOG_FILE
    _LOG_FILE = path


def out_dir() -> Path:
    return Path(os.environ.get("OUT") or "bench_out")


def write_json(path: Path, obj) -> None:
    """Atomic: a run killed while writing leaves the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)


def _jsonable(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    return str(v)


class Results:
    """`<out>/<bench>.json` = {"bench", "meta", "rows"}, rewritten after every added row."""

    def __init__(self, out: Path, bench: str, meta: dict | None = None):
        self.path = out / f"{bench}.json"
        self.doc = {"bench": bench, "meta": dict(meta or {}), "rows": []}
        if self.path.exists():  # a second driver call into the same folder adds to it
            try:
                old = json.loads(self.path.read_text())
                self.doc["rows"] = old.get("rows", [])
            except (OSError, ValueError):
                pass

    def add(self, **row) -> dict:
        row.setdefault("status", "ok")
        self.doc["rows"].append(row)
        write_json(self.path, self.doc)
        return row

    def skip(self, reason: str, **row) -> dict:
        log(f"  skipped {self.doc['bench']} {row}: {reason}")
        return self.add(status="skipped", reason=reason, **row)

    def error(self, err: BaseException, **row) -> dict:
        log(f"  ERROR in {self.doc['bench']} {row}: {type(err).__name__}: {str(err)[:400]}")
        return self.add(status="error", reason=f"{type(err).__name__}: {str(err)[:1000]}", **row)


class Budget:
    """Wall-clock budget of this driver call: a phase starts only when its estimate still fits, so that a
    remote call ends (with its JSON written) before the machine's own limit kills it."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.time() - START)

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s


# ----------------------------------------------------------------------------------------------------
# The vLLM plugin: vLLM finds the Muse model through the `vllm.general_plugins` entry point in every process
# it starts. On the GPU machine the repo is on PYTHONPATH, not pip-installed, so there is no entry point;
# a one-file dist-info directory on PYTHONPATH provides it (importlib.metadata scans sys.path), for the
# engine processes vLLM forks or spawns and for Ray workers alike.

PLUGIN_VALUE = "rollout.models:register"
PLUGIN_NAME = "sparkrl_bench_models"  # its own name: VLLM_PLUGINS=sparkrl_bench_models selects it alone


def write_plugin_dist(root: Path) -> Path:
    """A dist-info directory under `root` declaring the entry point; `root` must then be on sys.path."""
    dist = Path(root) / "sparkrl_bench_plugin-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sparkrl-bench-plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_NAME} = {PLUGIN_VALUE}\n")
    return dist


def ensure_vllm_plugin(root: Path, force: bool = False) -> str:
    """Make the entry point visible here and in child processes; returns how ("installed" / a path).
    `force` (env SPARKRL_BENCH_PLUGIN_DIST=1) writes ours even where the package's is installed."""
    from importlib.metadata import entry_points

    force = force or os.environ.get("SPARKRL_BENCH_PLUGIN_DIST") == "1"
    if not force and any(ep.value == PLUGIN_VALUE for ep in entry_points(group="vllm.general_plugins")):
        return "installed"
    write_plugin_dist(root)
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if not any(ep.name == PLUGIN_NAME for ep in entry_points(group="vllm.general_plugins")):
        raise RuntimeError(f"the vLLM plugin entry point written under {root} is not visible")
    return str(root)


# ----------------------------------------------------------------------------------------------------
# Environment record.


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "?")
    except Exception:  # noqa: BLE001 - absent or broken: record that, do not fail the run
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def env_info(args: dict, module: str = "bench.run_all") -> dict:
    """GPU, driver, versions, date and the command: the header of docs/benchmarks.md."""
    repo = Path(__file__).resolve().parent.parent
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", module] + sys.argv[1:]),
        "args": args,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpu": _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "versions": {
            m: _version(m)
            for m in ("torch", "vllm", "transformers", "peft", "ray", "compressed_tensors", "triton")
        },
        "git_commit": _run(["git", "-C", str(repo), "rev-parse", "HEAD"]),
        # adapters are staged under /dev/shm (a container may give it only 64 MB); models under --root
        "free_gb": {
            d: round(shutil.disk_usage(d).free / 1e9, 1) for d in ("/dev/shm", "/tmp") if Path(d).is_dir()
        },
    }
