"""Run checkpoints: `checkpoints/step_<N>/` with the trainer's part, the driver's state and a manifest.

A checkpoint is assembled in `step_<N>.tmp/`; its last file is `manifest.json` (every file's size and
SHA-256), and then the directory is renamed into place. Resume takes the newest checkpoint whose files all
match its manifest: one cut short by a crash, truncated or missing a file on a copy, or without a manifest
is named with the file at fault and skipped for the one before it. Older checkpoints are pruned only after
the new one is in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d+)$")
DRIVER_STATE = "driver_state.json"
MANIFEST = "manifest.json"


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Every `step_<N>` directory of a run (verified or not), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_manifest(directory: Path) -> Path:
    """`manifest.json`: size and SHA-256 of every file under `directory`, written atomically."""
    directory = Path(directory)
    files = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[f.relative_to(directory).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"files": files}, indent=2, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MANIFEST)
    return directory / MANIFEST


def verify_checkpoint(checkpoint: Path) -> str | None:
    """None when every file the manifest lists is there with its size and checksum; else what is wrong,
    naming the file."""
    checkpoint = Path(checkpoint)
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return f"{manifest}: missing (the checkpoint was not completely written)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{manifest}: not a readable manifest ({e})"
    if DRIVER_STATE not in files:
        return f"{manifest}: does not list {DRIVER_STATE}"
    for name, want in files.items():
        f = checkpoint / name
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if _sha256(f) != want["sha256"]:
            return f"{f}: its SHA-256 differs from the manifest's (damaged)"
    return None


def latest_checkpoint(run_dir: Path, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint that verifies; each newer one that does not is reported (stderr by default)
    with the file at fault."""
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    for _, path in reversed(checkpoint_dirs(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        report(f"checkpoint: skipping {path.name}: {problem}")
    return None


def save_checkpoint(
    run_dir: Path, step: int, driver_state: dict, save_trainer: Callable[[Path], None], keep: int = 0
) -> Path:
    """Write checkpoint `step`: `save_trainer(dir)` fills `dir/trainer`; then the driver state; then the
    manifest; then the rename."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_trainer(tmp / "trainer")
    (tmp / DRIVER_STATE).write_text(json.dumps(driver_state, indent=2) + "\n")
    write_manifest(tmp)
    if final.exists():  # re-saving the same step (e.g. SIGTERM right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep > 0:
        for _, old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_driver_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / DRIVER_STATE).read_text())
