"""Private, atomic staging of weights that a vLLM engine reads from disk (adapters, merged weights).

vLLM loads a LoRA adapter from a directory, so every sync writes one. It goes to a per-run directory
(mode 0700: adapters are model weights) on the worker's own node, under that node's staging base
(`SPARKRL_STAGE_DIR` where the node's environment sets it, else /dev/shm where writable: RAM, no disk
write; else the temp directory), each worker in a subdirectory of its own, and each version is written
to a temporary name and renamed into place so that the engine never sees a half-written adapter. The
driver names the directory; each worker resolves the name on its node, so no path crosses nodes.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# Set in a node's environment (`ray start` there, or a container's env): where its rollout workers stage
# weights, e.g. a RAM disk of its own where the node's /dev/shm is a container's 64 MiB.
STAGE_DIR_ENV = "SPARKRL_STAGE_DIR"


def stage_base() -> Path:
    """This node's staging base: $SPARKRL_STAGE_DIR, else /dev/shm where writable, else the temp directory."""
    if configured := os.environ.get(STAGE_DIR_ENV):
        return Path(configured)
    base = Path("/dev/shm")
    if base.is_dir() and os.access(base, os.W_OK):
        return base
    return Path(tempfile.gettempdir())


# What a name keeps as it is in the staging directory's name; the rest becomes '_'.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+=,-]")
_MAX_NAME = 80


def stage_dir_name(name: str) -> str:
    """A file name for any run name: a sweep's `<sweep>/<point>` (slashes), a user's spaces or dots, a long
    name. Kept as it is when already safe and short; otherwise made safe and cut, with a hash of the whole
    name so that two names that differ only in the parts replaced or cut stay apart."""
    safe = _UNSAFE.sub("_", name)[:_MAX_NAME].lstrip(".") or "run"
    if safe == name:
        return safe
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:10]}"


def stage_root(stage: str | Path) -> Path:
    """The staging directory `stage` names on the calling node: an absolute path as it is; a name (a run's,
    whatever characters it holds) `<stage_base()>/sparkrl-<user>-<stage_dir_name(name)>`."""
    if Path(stage).is_absolute():
        return Path(stage)
    user = _UNSAFE.sub("_", getpass.getuser())
    return stage_base() / f"sparkrl-{user}-{stage_dir_name(str(stage))}"


class StageDir:
    """A worker's private staging directory under `root`; `stage(name, write)` publishes `root/.../name`."""

    def __init__(self, root: str | Path):
        root = Path(root)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if root.stat().st_uid != os.getuid():
            raise PermissionError(f"stage directory {root} belongs to another user; pick another run name")
        # mkdtemp creates it with mode 0700 and a name no other worker has.
        self.dir = Path(tempfile.mkdtemp(prefix=f"worker-{os.getpid()}-", dir=root))

    def stage(self, name: str, write: Callable[[Path], None]) -> Path:
        """Call `write(tmp_dir)`, then rename tmp_dir to `self.dir / name` (replacing an older one)."""
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=self.dir))
        try:
            write(tmp)
            final = self.dir / name
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def remove(self, name: str) -> None:
        shutil.rmtree(self.dir / name, ignore_errors=True)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
