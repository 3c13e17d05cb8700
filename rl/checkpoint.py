"""Run checkpoints: `checkpoints/step_<N>/` with the trainer's part, the driver's state and a manifest.

A checkpoint is assembled in `step_<N>.tmp/`; its last file is `manifest.json` (every file's size and
SHA-256), and then the directory is renamed into place. A checkpoint *verifies* when every file its
manifest lists is there with its size and checksum.

What keeps a run from losing its work:
- Resume (`Checkpoints.for_resume`) takes the newest checkpoint that verifies. Every checkpoint above it
  (damaged, or cut short while being written) and every leftover `step_<N>.tmp/` is moved aside to
  `checkpoints/damaged/`, with a `why.txt` naming the file at fault, so that the resumed run's own
  checkpoints of those steps never meet them. With no checkpoint that verifies, resume is an error naming
  each one and its fault; nothing is moved and nothing restarts.
- Pruning (`trainer.keep_checkpoints`) counts checkpoints that verify: it keeps that many good ones, the
  one just written always among them, moves damaged ones aside instead of counting them, and deletes
  only good checkpoints older than the ones kept.
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

from rl.metrics import read_metrics

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")
# A checkpoint being replaced by a new save of its step: renamed to this, the new one renamed into place,
# then this removed. A crash between the two renames leaves it, and resume puts it back.
_REPLACED_DIR = re.compile(r"^\.step_(\d+)\.replaced$")
DRIVER_STATE = "driver_state.json"
MANIFEST = "manifest.json"
DAMAGED = "damaged"
WHY = "why.txt"


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Every `step_<N>` directory of a run (verified or not), oldest first."""
    return _dirs(run_dir, _STEP_DIR)


def _dirs(run_dir: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = pattern.match(p.name)
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


def _manifest_files(checkpoint: Path) -> tuple[dict | None, str | None]:
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return None, f"{manifest}: missing (the checkpoint was not completely written)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return None, f"{manifest}: not a readable manifest ({e})"
    if DRIVER_STATE not in files:
        return None, f"{manifest}: does not list {DRIVER_STATE}"
    return files, None


def verify_checkpoint(checkpoint: Path, checksums: bool = True) -> str | None:
    """None when every file the manifest lists is there with its size (and, with `checksums`, its SHA-256);
    else what is wrong, naming the file."""
    checkpoint = Path(checkpoint)
    files, problem = _manifest_files(checkpoint)
    if problem:
        return problem
    for name, want in files.items():
        f = checkpoint / name
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if checksums and _sha256(f) != want["sha256"]:
            return f"{f}: its SHA-256 differs from the manifest's (damaged)"
    return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def latest_checkpoint(run_dir: Path, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint that verifies; each newer one that does not is reported (stderr by default)
    with the file at fault. Reads only: `sparkrl eval RUN` and messages use it on a run that may be live."""
    report = report or _stderr
    for _, path in reversed(checkpoint_dirs(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        report(f"checkpoint: skipping {path.name}: {problem}")
    return None


class NoCheckpointToResume(FileNotFoundError):
    """`--resume` found no checkpoint that verifies; the message names each one and its fault."""


def load_driver_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / DRIVER_STATE).read_text())


class Checkpoints:
    """The checkpoints of one run, as the run that writes them sees them: resume, save, prune.

    A checkpoint is verified in full (every checksum) once per process; after that, pruning re-checks only
    that its files are there with their sizes, so a run keeping three checkpoints of an 816B model's adapter
    and optimizer does not hash them all again at every save.
    """

    def __init__(self, run_dir: Path, keep: int = 0, report: Callable[[str], None] | None = None):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.keep = keep
        self.report = report or _stderr
        self._hashed: set[Path] = set()  # verified in full by this process

    # -- resume --------------------------------------------------------------------------------------

    def for_resume(self) -> Path | None:
        """The newest checkpoint that verifies, with everything above it moved aside (named, with its fault).
        None for a run that never recorded a step (no checkpoint, no metrics): it starts at step 0.
        Raises NoCheckpointToResume, changing nothing, when checkpoints or recorded steps exist but no
        checkpoint verifies."""
        self._restore_replaced()
        damaged: list[tuple[Path, str]] = []
        chosen = None
        for _, path in reversed(checkpoint_dirs(self.run_dir)):
            problem = self._verify(path)
            if problem is None:
                chosen = path
                break
            damaged.append((path, problem))
        if chosen is None:
            recorded = len(read_metrics(self.run_dir))
            if damaged or recorded:
                raise NoCheckpointToResume(self._nothing_to_resume(damaged, recorded))
            return None
        for path, problem in damaged:
            self._set_aside(path, f"above the resume point {chosen.name} and does not verify: {problem}")
        for _, tmp in _dirs(self.run_dir, _TMP_DIR):
            self._set_aside(tmp, "cut short while being written (no manifest; the rename never happened)")
        return chosen

    def _nothing_to_resume(self, damaged: list[tuple[Path, str]], recorded: int) -> str:
        lines = [f"--resume: {self.run_dir} has no checkpoint that verifies, so there is nothing to resume"]
        if recorded:
            lines[0] += f" (metrics.jsonl records {recorded} step(s))"
        lines += [f"  {path.name}: {problem}" for path, problem in damaged]
        lines.append(
            "Nothing was changed. Put a good copy of a checkpoint back under checkpoints/, or start a new "
            "run (another run.name or run.dir)."
        )
        return "\n".join(lines)

    def _restore_replaced(self) -> None:
        for step, old in _dirs(self.run_dir, _REPLACED_DIR):
            final = self.root / f"step_{step}"
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:  # the crash fell between the two renames of a re-save: the old one is the checkpoint
                os.rename(old, final)

    # -- save and prune ------------------------------------------------------------------------------

    def save(self, step: int, driver_state: dict, save_trainer: Callable[[Path], None]) -> Path:
        """Write checkpoint `step`: `save_trainer(dir)` fills `dir/trainer`; then the driver state; then the
        manifest; then the rename; then the pruning."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_trainer(tmp / "trainer")
        (tmp / DRIVER_STATE).write_text(json.dumps(driver_state, indent=2) + "\n")
        write_manifest(tmp)
        if final.exists():  # a second save of one step (a stop right after a periodic save)
            old = self.root / f".step_{step}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        self._hashed.add(final)  # its manifest was made from the files just written
        self.prune(step)
        return final

    def prune(self, current: int) -> None:
        """Keep the newest `keep` checkpoints that verify (`current`'s, just written, first); move aside the
        damaged ones and any above `current` (a resume point before them makes them stale); delete older
        good ones. keep=0 keeps everything."""
        if self.keep <= 0:
            return
        good: list[Path] = []
        for step, path in reversed(checkpoint_dirs(self.run_dir)):
            if step > current:
                self._set_aside(path, f"above step {current}, the step this run has reached (stale)")
                continue
            problem = self._verify(path)
            if problem is not None:
                self._set_aside(path, problem)
                continue
            good.append(path)
        for path in good[self.keep :]:
            shutil.rmtree(path, ignore_errors=True)
            self._hashed.discard(path)

    # -- helpers -------------------------------------------------------------------------------------

    def _verify(self, path: Path) -> str | None:
        problem = verify_checkpoint(path, checksums=path not in self._hashed)
        if problem is None:
            self._hashed.add(path)
        else:
            self._hashed.discard(path)
        return problem

    def _set_aside(self, path: Path, why: str) -> Path:
        """Move `path` to `checkpoints/damaged/<name>` (`<name>-2`, ... where taken), with `why.txt`."""
        dest_root = self.root / DAMAGED
        dest_root.mkdir(parents=True, exist_ok=True)
        dest, n = dest_root / path.name, 1
        while dest.exists():
            n += 1
            dest = dest_root / f"{path.name}-{n}"
        os.rename(path, dest)
        self._hashed.discard(path)
        (dest / WHY).write_text(why + "\n")
        self.report(f"checkpoint: moved {path.name} aside to {dest}: {why}")
        return dest


def save_checkpoint(
    run_dir: Path, step: int, driver_state: dict, save_trainer: Callable[[Path], None], keep: int = 0
) -> Path:
    """`Checkpoints(run_dir, keep).save(...)` for a caller without a Checkpoints of its own."""
    return Checkpoints(run_dir, keep).save(step, driver_state, save_trainer)
