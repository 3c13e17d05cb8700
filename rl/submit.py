"""`sparkrl submit RECIPE [key=value ...]`: run `sparkrl train` as a Ray job (the Job SDK, what `ray job
submit` uses), print the job id and follow its logs.

    client = make_client("http://127.0.0.1:8265")          # else $RAY_ADDRESS
    job = submit_run(client, "recipes/demo_cpu.yaml", ["trainer.total_steps=1"])
    status = follow(client, job.job_id)                    # "SUCCEEDED", "FAILED" or "STOPPED"

What the job gets:
- The code: this checkout is uploaded as the job's working directory (Ray's runtime env), minus the venv,
  runs, caches and VCS data (EXCLUDES); the job's `python -m rl` imports that copy.
- The interpreter: the entrypoint names one explicitly, because Ray runs it with the `python` on the
  cluster's PATH, not this venv's. The default is this process's interpreter, right for a local cluster
  and for clusters whose nodes share the same venv path; elsewhere pass `--python /path/on/the/cluster`.
- The run directory: the job runs inside Ray's unpacked copy of the project, so a relative `run.dir`
  would land there and vanish with the session. `run.dir` is therefore made absolute: `<cwd>/runs/<name>`
  as a local run would use, or `--runs-root DIR/<name>`. The head node must see that path (true on a
  local cluster or a shared filesystem). Local files the config names (model and data paths, the files of
  import paths) are named as the job finds them: relative to its working directory where the upload carries
  them (Ray's walk decides, .gitignore included), else absolute, with a note that the cluster must see them.
- Environment: only PYTHONUNBUFFERED and what `--env` names. Cluster-wide settings (NCCL, vLLM, HF
  caches) belong in the node environment set by launch/head.sh and launch/worker.sh; secrets should stay
  there too, since a job's runtime env is shown on the dashboard.

Auth: with token authentication on (launch/head.sh sets RAY_AUTH_MODE=token), export RAY_AUTH_MODE=token
and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) here too; the SDK then sends the token with every request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import logging
import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rl.config import ConfigError, code_values, find_recipe
from rl.core import user_code

# The checkout this code runs from: what gets uploaded (None for a non-editable install).
_CHECKOUT = Path(__file__).resolve().parent.parent
PROJECT_ROOT: Path | None = _CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else None
# Left out of the upload: Ray caps a working dir at a few hundred MB, and none of these is code.
EXCLUDES = [
    ".venv",
    "venv",
    ".git",
    "runs",
    "checkpoints",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".cache",
    ".kit",
    ".whl",
    "*.safetensors",
    "*.pt",
    "*.bin",
    "*.gguf",
]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# How long a submission waits for a fresh cluster's job agent ("No available agent ... try again later").
AGENT_WAIT_S = 120.0
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Config keys that may name a local file or directory (data specs may carry a ?query).
PATH_KEYS = ("model.path", "model.rollout_path", "data.train", "eval.data")
SUBMITTED_ENV = "SPARKRL_SUBMITTED"  # set in a submitted job's environment
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", re.I)


@dataclass
class TrainCommand:
    argv: list[str]  # python -m rl train RECIPE overrides... run.dir=<abs>
    run_dir: Path
    run_name: str
    notes: list[str] = field(default_factory=list)  # local paths the job reads where they are (not uploaded)


@dataclass
class SubmittedJob:
    job_id: str
    entrypoint: str
    run_dir: Path


# ----------------------------------------------------------------------------------------------------
# The client and the job's runtime environment
# ----------------------------------------------------------------------------------------------------


def resolve_address(address: str | None) -> str:
    return address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def make_client(address: str | None = None):
    """A JobSubmissionClient for `address` (else $RAY_ADDRESS, else the local dashboard's default)."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    address = resolve_address(address)
    # Ray lets $RAY_ADDRESS / $RAY_API_SERVER_ADDRESS override the address argument; an explicit
    # --address must win, so hide them while the client resolves it.
    hidden = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ}
    try:
        try:
            return JobSubmissionClient(address)
        except AuthenticationError:
            # The cluster wants a token. `ray start` turns token auth on by itself once ~/.ray/auth_token
            # exists, but the Job SDK only sends one under RAY_AUTH_MODE=token: do what `ray start` does,
            # only now that the server has asked, and only when the mode was left unset.
            if "RAY_AUTH_MODE" in os.environ or not _enable_token_auth_if_token_available():
                raise
            return JobSubmissionClient(address)
    except AuthenticationError as e:
        raise ConnectionError(
            f"the Ray job server at {address} refused us: {e}\nExport "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) with the "
            "cluster's token"
        ) from None
    except (ConnectionError, RuntimeError) as e:
        raise ConnectionError(
            f"cannot reach the Ray job server at {address} ({e}); start a cluster "
            "(launch/head.sh) or pass --address / set RAY_ADDRESS"
        ) from None
    finally:
        os.environ.update(hidden)


def _enable_token_auth_if_token_available() -> bool:
    try:  # a private Ray helper (there in Ray 2.60); without it the user sets RAY_AUTH_MODE=token
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return False
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def parse_env(items: list[str] | None) -> dict[str, str]:
    """['A=1', 'B'] -> {'A': '1', 'B': <B from this environment>}."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_]\w*", key):
            raise ValueError(f"--env {item!r}: expected KEY=VALUE or KEY")
        if not sep:
            if key not in os.environ:
                raise ValueError(f"--env {key}: not set in this environment (give KEY=VALUE)")
            value = os.environ[key]
        if _SECRET.search(key):
            print(
                f"submit: warning: {key} goes into the job's runtime env, which the dashboard shows; "
                "prefer setting secrets in the node environment",
                file=sys.stderr,
            )
        out[key] = value
    return out


def runtime_env(working_dir: Path | None = PROJECT_ROOT, env: dict[str, str] | None = None) -> dict:
    # PYTHONUNBUFFERED: logs stream as they are written; SUBMITTED_ENV: the run's own advice says to resume
    # it as a job
    renv: dict = {"env_vars": {"PYTHONUNBUFFERED": "1", SUBMITTED_ENV: "1", **(env or {})}}
    if working_dir is not None:
        renv.update(working_dir=str(working_dir), excludes=list(EXCLUDES))
    return renv


def uploaded_files(working_dir: Path) -> frozenset[Path] | None:
    """The files (resolved) Ray's upload of `working_dir` carries, found by the walk the upload itself makes:
    EXCLUDES and, as the Job SDK does unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1, every `.gitignore` and
    `.rayignore` on the way (ray._private.runtime_env.packaging; private: None where it is missing, and
    EXCLUDES alone decide)."""
    try:
        from ray._private.runtime_env.packaging import _dir_travel, _get_excludes
    except ImportError:
        return None
    root = working_dir.resolve()
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    files: set[Path] = set()
    quiet = logging.getLogger("sparkrl.submit.upload_walk")  # Ray logs each ignore file it reads
    quiet.setLevel(logging.ERROR)
    _dir_travel(
        root,
        [_get_excludes(root, EXCLUDES)],
        lambda p: files.add(p.resolve()) if p.is_file() else None,
        include_gitignore=include_gitignore,
        logger=quiet,
    )
    return frozenset(files)


def is_uploaded(
    path: Path, working_dir: Path | None = PROJECT_ROOT, files: frozenset[Path] | None = None
) -> bool:
    """Whether `path` (a file, or a directory with every file in it) travels with the job's working dir.
    files: `uploaded_files(working_dir)`, when already walked."""
    if working_dir is None:
        return False
    path = path.resolve()
    try:
        rel = path.relative_to(working_dir.resolve())
    except ValueError:
        return False
    files = files if files is not None else uploaded_files(working_dir)
    if files is None:
        return not any(fnmatch.fnmatch(part, pat) for part in rel.parts for pat in EXCLUDES)
    if path.is_dir():
        inside = [f.resolve() for f in path.rglob("*") if f.is_file()]
        return bool(inside) and all(f in files for f in inside)
    return path in files


# ----------------------------------------------------------------------------------------------------
# The train entrypoint
# ----------------------------------------------------------------------------------------------------


def job_run_dir(cfg, runs_root: str | Path | None) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir).absolute()
    return (Path(runs_root) if runs_root else Path("runs")).absolute() / cfg.run.name


def _mlflow_uri(uri: str) -> str | None:
    """A tracking URI of a relative local path (sqlite:///mlflow.db, file:mlruns, a bare directory) made
    absolute here; None for a server or an absolute path."""
    for scheme in ("sqlite:///", "file:"):
        if uri.startswith(scheme):
            rest = uri[len(scheme) :]
            return None if rest.startswith("/") else f"{scheme}{Path(rest).absolute()}"
    return None if "://" in uri or Path(uri).is_absolute() else str(Path(uri).absolute())


def _job_paths(cfg, working_dir: Path | None, files: frozenset[Path] | None) -> tuple[list[str], list[str]]:
    """(overrides, notes): every local file or directory the config names (PATH_KEYS, the files of CODE_KEYS'
    import paths), named as the job finds it: relative to the job's working directory (the upload's root,
    where the job runs) when the upload carries it, else absolute, with a note that the cluster must see that
    path (a local cluster, or a shared filesystem). A relative MLflow store is made absolute (the upload's
    copy is gone after the job). files: `uploaded_files(working_dir)`."""
    overrides, notes = [], []

    def job_name(key: str, local: Path) -> str:
        local = local.expanduser().resolve()
        if is_uploaded(local, working_dir, files):
            return local.relative_to(working_dir.resolve()).as_posix()
        notes.append(
            f"{key}: {local} is not in the upload (outside {working_dir}, or left out by its .gitignore or "
            "the excludes); the job reads it at that path, which the cluster's nodes must see"
        )
        return str(local)

    for key in PATH_KEYS:
        section, leaf = key.split(".")
        path, sep, query = getattr(getattr(cfg, section), leaf).partition("?")
        if path and Path(path).expanduser().exists():
            overrides.append(f"{key}={job_name(key, Path(path))}{sep}{query}")
    for key, value in code_values(cfg):
        if user_code.is_import_path(value) and user_code.problem(value) is None:
            target, name = user_code.split(value)
            if user_code.is_file(target):
                overrides.append(f"{key}={job_name(key, Path(target))}:{name}")
    uri = cfg.logging.mlflow_tracking_uri and _mlflow_uri(cfg.logging.mlflow_tracking_uri)
    if uri:
        overrides.append(f"logging.mlflow_tracking_uri={uri}")
    return overrides, notes


def train_command(
    recipe: str,
    overrides: list[str],
    *,
    python: str = sys.executable,
    runs_root: str | Path | None = None,
    working_dir: Path | None = PROJECT_ROOT,
    resume: bool = False,
) -> TrainCommand:
    """The job's argv `python -m rl train RECIPE overrides... run.dir=<abs>`, its run directory and name.
    Loads the config here first, so a bad recipe or override fails before anything is submitted. A run
    directory is that run, where it lies now (rl.target.load_target)."""
    from rl.target import load_target

    cfg = load_target(recipe, overrides)
    path = find_recipe(recipe)
    files = uploaded_files(working_dir) if working_dir is not None else None
    if working_dir is not None and is_uploaded(path.absolute(), working_dir, files):
        recipe_arg = path.resolve().relative_to(working_dir.resolve()).as_posix()
    else:
        recipe_arg = str(path.absolute())  # the cluster must see this path (shared filesystem)
    rdir = job_run_dir(cfg, runs_root)
    paths, notes = _job_paths(cfg, working_dir, files)
    argv = [python, "-m", "rl", "train", recipe_arg, *overrides, *paths, f"run.dir={rdir}"]
    return TrainCommand(argv + (["--resume"] if resume else []), rdir, cfg.run.name, notes)


def submission_id(run_name: str) -> str:
    """Readable and unique: sparkrl-<run name>-<time>-<random> (no '/', which job URLs cannot hold)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", run_name)[:80]
    return f"sparkrl-{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


# ----------------------------------------------------------------------------------------------------
# Submitting, following, waiting
# ----------------------------------------------------------------------------------------------------


def submit_entrypoint(
    client,
    entrypoint: str,
    *,
    renv: dict | None = None,
    job_id: str | None = None,
    metadata: dict[str, str] | None = None,
) -> str:
    """Submit any shell command as a job; returns its submission id.

    A cluster that has just started answers "No available agent to submit job, please try again later"
    until its head's job agent has registered: that answer is retried every 2 s for up to
    `AGENT_WAIT_S`, then reported as an error that says so."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(
                entrypoint=entrypoint,
                runtime_env=renv if renv is not None else runtime_env(),
                submission_id=job_id,
                metadata=metadata,
            )
        except RuntimeError as e:
            if "try again later" not in str(e):
                raise
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the cluster's job agent did not come up within {AGENT_WAIT_S:.0f} s ({e}); check "
                    "`ray status` and the head's dashboard_agent.log"
                ) from e
            time.sleep(2)


def submit_run(
    client,
    recipe: str,
    overrides: list[str],
    *,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    runs_root: str | Path | None = None,
    working_dir: Path | None = PROJECT_ROOT,
    resume: bool = False,
) -> SubmittedJob:
    cmd = train_command(
        recipe, overrides, python=python, runs_root=runs_root, working_dir=working_dir, resume=resume
    )
    entrypoint = shlex.join(cmd.argv)
    job_id = submit_entrypoint(
        client,
        entrypoint,
        renv=runtime_env(working_dir, env),
        job_id=submission_id(cmd.run_name),
        metadata={"sparkrl_recipe": str(recipe), "sparkrl_run_dir": str(cmd.run_dir)},
    )
    return SubmittedJob(job_id, entrypoint, cmd.run_dir)


def status_of(client, job_id: str) -> str:
    status = client.get_job_status(job_id)
    return getattr(status, "value", str(status))


def wait(client, job_id: str, poll_s: float = 1.0, timeout_s: float | None = None) -> str:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED; returns that status."""
    start = time.monotonic()
    while (status := status_of(client, job_id)) not in TERMINAL:
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"job {job_id} still {status} after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return status


def wait_any(client, job_ids: list[str], poll_s: float = 2.0) -> tuple[str, str]:
    """(job id, final status) of the first of `job_ids` to finish."""
    while True:
        for job_id in job_ids:
            status = status_of(client, job_id)
            if status in TERMINAL:
                return job_id, status
        time.sleep(poll_s)


async def _tail(client, job_id: str, out) -> None:
    async for chunk in client.tail_job_logs(job_id):
        out.write(chunk)
        out.flush()


def follow(client, job_id: str, out=None, poll_s: float = 1.0) -> str:
    """Stream the job's logs to `out` (stdout) until it ends; returns its final status."""
    out = out or sys.stdout
    try:
        asyncio.run(_tail(client, job_id, out))
    except RuntimeError as e:  # the log stream broke off; the job itself may still be running
        print(f"submit: log stream of {job_id} ended early ({e}); waiting for the job", file=sys.stderr)
    return wait(client, job_id, poll_s)


def _explain(client, job_id: str, status: str) -> str:
    with contextlib.suppress(Exception):
        message = client.get_job_info(job_id).message
        if message:
            return f"{status}: {message}"
    return status


# ----------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    working_dir = Path(args.working_dir).resolve() if args.working_dir else PROJECT_ROOT
    env = parse_env(args.env)
    try:  # check the config before contacting the cluster
        cmd = train_command(
            args.recipe, args.overrides, python=args.python, runs_root=args.runs_root, working_dir=working_dir
        )
    except ConfigError as e:
        print(f"sparkrl submit: {e}", file=sys.stderr)
        return 2
    for note in cmd.notes:
        print(f"submit: note: {note}", file=sys.stderr)
    try:
        client = make_client(args.address)
        job = submit_run(
            client,
            args.recipe,
            args.overrides,
            python=args.python,
            env=env,
            runs_root=args.runs_root,
            working_dir=working_dir,
            resume=args.resume,
        )
    except (ConnectionError, RuntimeError) as e:  # unreachable cluster, refused token, refused job
        print(f"sparkrl submit: {e}", file=sys.stderr)
        return 2
    print(f"submit: job {job.job_id} on {resolve_address(args.address)}")
    print(f"submit: entrypoint {job.entrypoint}")
    print(
        f"submit: run dir {job.run_dir} (resume it as a job: `sparkrl submit {job.run_dir} --resume`)",
        flush=True,
    )
    if args.no_wait:
        print(
            f"submit: follow with `ray job logs --follow {job.job_id}`; stop with `ray job stop {job.job_id}`"
        )
        return 0
    try:
        status = follow(client, job.job_id)
    except KeyboardInterrupt:  # as `ray job submit` does: detach, the job keeps running
        print(f"\nsubmit: detached; job {job.job_id} keeps running (`ray job stop {job.job_id}` ends it)")
        return 130
    print(f"submit: job {job.job_id} {_explain(client, job.job_id, status)}")
    return 0 if status == "SUCCEEDED" else 1


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "submit",
        help="run `sparkrl train RECIPE [key=value ...]` as a Ray job and follow its logs",
        description="Submit `python -m rl train RECIPE [key=value ...]` to a Ray cluster (the Job SDK, as "
        "`ray job submit`), with this checkout as the job's working directory. Prints the job id "
        "and follows the logs unless --no-wait; the exit code follows the job's final status.",
    )
    p.add_argument("recipe", metavar="RECIPE")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument(
        "--address",
        default=None,
        help=f"Ray dashboard address (default: $RAY_ADDRESS, else {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter the job runs, as a path on the cluster's head node (default: this one, "
        f"{sys.executable}: right for a local cluster or one that shares this venv path; "
        "Ray would otherwise use the cluster's `python` on PATH)",
    )
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument(
        "--runs-root",
        default=None,
        help="directory the run goes under, as seen from the head node (default: ./runs, made "
        "absolute; needs a filesystem the cluster shares)",
    )
    p.add_argument(
        "--working-dir",
        default=None,
        help="directory uploaded as the job's working dir (default: this sparkrl checkout)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="environment variable for the job (repeatable; KEY alone copies it from here)",
    )
    p.add_argument("--resume", action="store_true", help="pass --resume to train")
    p.set_defaults(func=main)
    return p
