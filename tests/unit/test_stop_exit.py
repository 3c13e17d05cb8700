"""How a run stopped by a signal ends: its summary line, its exit code (130 for SIGINT, 143 for SIGTERM),
and a local sweep that hands the signal to its run once and stops there.

The driver's side (a SIGTERM finishes the step, writes the checkpoint and sets `stopped_by`) runs in
tests/integration/test_train_runs.py; here `rl.driver.train` is replaced by a function returning the
summary such a run returns, to check what the command makes of it without starting Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rl import cli
from rl.driver import StoppedAtOnce

ROOT = Path(__file__).resolve().parents[2]


def _summary(**kw) -> dict:
    base = {
        "run_dir": "/runs/x",
        "steps": 26,
        "first_step": 21,
        "total_steps": 26,
        "stopped_by": None,
        "seconds": 60.0,
        "k3_kl_mean": None,
        "k3_kl_max": None,
    }
    return {**base, **kw}


def test_summary_counts_the_steps_this_invocation_ran(capsys, monkeypatch):
    cli.print_summary(_summary())
    assert (
        capsys.readouterr().out.splitlines()[0] == "done: 26 of 26 steps: 6 this run (steps 21-26) in 1.0 min"
    )
    cli.print_summary(_summary(steps=3, first_step=1, total_steps=200, stopped_by="SIGINT"))
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("stopped at step 3 of 200 by SIGINT (checkpoint written): 3 this run (steps 1-3)")
    assert "sparkrl train /runs/x --resume" in line
    monkeypatch.setenv("SPARKRL_SUBMITTED", "1")  # a Ray job that `sparkrl submit` started resumes as one
    cli.print_summary(_summary(steps=3, first_step=1, total_steps=200, stopped_by="SIGTERM"))
    assert "continue with `sparkrl submit /runs/x --resume`" in capsys.readouterr().out
    monkeypatch.delenv("SPARKRL_SUBMITTED")
    cli.print_summary(_summary(steps=21, first_step=21))
    assert "1 this run (step 21)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "outcome,code",
    [
        (None, 0),
        ("SIGINT", 130),
        ("SIGTERM", 143),
        (StoppedAtOnce("SIGTERM", 4), 143),
        (KeyboardInterrupt(), 130),
    ],
)
def test_train_command_exit_codes(monkeypatch, tmp_path, capsys, outcome, code):
    import rl.driver
    import rl.preflight

    def fake_train(cfg, resume=False):
        if isinstance(outcome, BaseException):
            raise outcome
        return _summary(run_dir=str(tmp_path), stopped_by=outcome)

    monkeypatch.setattr(rl.driver, "train", fake_train)
    monkeypatch.setattr(rl.preflight, "preflight", lambda cfg: None)
    assert cli.main(["train", "demo_cpu", f"run.dir={tmp_path / 'r'}"]) == code
    if isinstance(outcome, BaseException):
        err = capsys.readouterr().err
        assert "no checkpoint was written" in err
        assert "stopped at once during step 4" in err if isinstance(outcome, StoppedAtOnce) else True


def test_a_local_sweep_hands_a_ctrl_c_to_its_run_once_and_stops(tmp_path):
    """The terminal's Ctrl-C goes to the whole foreground process group. The sweep runs each point in a
    session of its own and forwards the signal: the run sees exactly one SIGINT (a second would stop it
    without its checkpoint), exits 130, and the sweep exits 130 too."""
    seen = tmp_path / "signals"
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(
            f"""
            import signal, sys, time
            got = []
            signal.signal(signal.SIGINT, lambda s, f: got.append(s))
            open({str(tmp_path / "ready")!r}, "w").close()
            while not got:
                time.sleep(0.05)
            time.sleep(1.0)  # a second SIGINT, if any, arrives in this time
            open({str(seen)!r}, "w").write(str(len(got)))
            sys.exit(130)
            """
        )
    )
    sweep = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; from rl.sweep import run_forwarding_signals; "
            f"sys.exit(run_forwarding_signals([sys.executable, {str(child)!r}]))",
        ],
        cwd=ROOT,
        start_new_session=True,  # its own group, standing for the terminal's foreground group
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert sweep.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(sweep.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        assert sweep.wait(timeout=60) == 130
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert seen.read_text() == "1"
