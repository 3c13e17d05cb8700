"""Run checkpoints: `checkpoints/step_<N>/` with the trainer's part and the driver's state.

A checkpoint is assembled in `step_<N>.tmp/` and renamed into place only when complete, so a crash while
saving never leaves a half checkpoint that a resume would pick up; older checkpoints are pruned after the
new one is in place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d+)$")
DRIVER_STATE = "driver_state.json"


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / DRIVER_STATE).exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1][1] if dirs else None


def save_checkpoint(
    run_dir: Path, step: int, driver_state: dict, save_trainer: Callable[[Path], None], keep: int = 0
) -> Path:
    """Write checkpoint `step`: `save_trainer(dir)` fills `dir/trainer`; then the driver state; then rename."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_trainer(tmp / "trainer")
    (tmp / DRIVER_STATE).write_text(json.dumps(driver_state, indent=2) + "\n")
    if final.exists():  # re-saving the same step (e.g. SIGTERM right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep > 0:
        for _, old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_driver_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / DRIVER_STATE).read_text())
