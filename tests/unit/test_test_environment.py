"""tests/conftest.py's `_environment_of_the_session`: a test file's changes to the environment variables
(vLLM's engine config sets LD_PRELOAD and a dozen more in the process that builds it) do not reach the
files that run after it in the same process, nor the processes those files start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

SETS = """
import os

def test_sets_and_changes():
    os.environ["SPARKRL_LEAK_PROBE"] = "1"
    os.environ["LD_LIBRARY_PATH"] = "/leaked"
"""

SEES = """
import os
import subprocess
import sys

def test_sees_the_session_environment():
    assert "SPARKRL_LEAK_PROBE" not in os.environ
    assert os.environ.get("LD_LIBRARY_PATH") == "/session"
    child = "import os; print(os.environ.get('SPARKRL_LEAK_PROBE'))"
    assert subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip() == "None"
"""


def test_a_file_s_variables_do_not_reach_the_next_file(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('sparkrl_tests_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "_environment_of_the_session = module._environment_of_the_session\n"
    )
    (tmp_path / "test_a_sets.py").write_text(SETS)
    (tmp_path / "test_b_sees.py").write_text(SEES)
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/session", "HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr
