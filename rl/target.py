"""What a command's first argument names, and where its run directory is.

`sparkrl train|eval|submit` take a recipe (a YAML file or a shipped recipe's name) plus `key=value`
overrides, or a run directory, which is that run wherever it lies now.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Set by Ray's job supervisor in the environment of a job's entrypoint (`ray job submit`, `sparkrl submit`):
# the job's config as JSON, its metadata holding the submission id.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def load_target(recipe: str, overrides: list[str]):
    """The config of `recipe` with `overrides`; a run directory is the run: its own config, and `run.dir`
    set to where the directory is now (it may have been moved or copied since it was written)."""
    from rl.config import load_config

    path = Path(recipe)
    if path.is_dir() and (path / "config.yaml").is_file():
        overrides = [f"run.dir={path.resolve()}", *overrides]
    return load_config(recipe, overrides)


def ray_job_id() -> str | None:
    """The submission id of the Ray job this process is the entrypoint of; None outside a job."""
    raw = os.environ.get(RAY_JOB_ENV)
    if raw is None:
        return None
    try:
        return str(json.loads(raw).get("metadata", {}).get("job_submission_id") or "(no id)")
    except (ValueError, AttributeError):
        return "(no id)"


def absolute_run_dir(cfg) -> Path:
    """The run directory as an absolute path, written back into `cfg.run.dir`. Inside a Ray job the working
    directory is Ray's temporary copy of the project, removed with the job's session, so a relative one
    is refused there."""
    from rl.config import run_dir

    rdir = run_dir(cfg)
    job = ray_job_id()
    if job and not rdir.is_absolute():
        raise ValueError(
            f"run.dir: {rdir} is relative, and this process runs inside the Ray job {job}, whose working "
            f"directory ({Path.cwd()}) is deleted with the job; pass run.dir=/an/absolute/path on a disk that "
            f"outlives it (`sparkrl submit` does so)"
        )
    cfg.run.dir = str(rdir.absolute())
    return Path(cfg.run.dir)
