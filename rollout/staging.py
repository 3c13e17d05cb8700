"""Private, atomic staging of weights that a vLLM engine reads from disk (adapters, merged weights).

vLLM loads a LoRA adapter from a directory, so every sync writes one. It goes to a per-run directory
(mode 0700: adapters are model weights) on /dev/shm where present (RAM, no disk write), each worker in
a subdirectory of its own, and each version is written to a temporary name and renamed into place so
that the engine never sees a half-written adapter.
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_stage_root(run_name: str) -> Path:
    """`/dev/shm/sparkrl-<user>-<run_name>` (or under the temp directory where /dev/shm is absent)."""
    base = Path("/dev/shm")
    if not (base.is_dir() and os.access(base, os.W_OK)):
        base = Path(tempfile.gettempdir())
    return base / f"sparkrl-{getpass.getuser()}-{run_name}"


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
