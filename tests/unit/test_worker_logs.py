"""Workers' output goes to the run's logs/ (rl/core/worker_logs.py): Python prints, native writes to fd 2, and a
child process's output all land in the role's file; nothing changes without a log directory."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

from rl.core.worker_logs import LOG_DIR_ENV, crash_report
from rollout.vllm_ext import ExpertReloadWarningFilter

CHILD = textwrap.dedent(
    """
    import os, subprocess, sys
    from rl.core.worker_logs import capture
    print("before capture", flush=True)
    path = capture("trainer-rank3")
    print("python print", flush=True)
    os.write(2, b"native write to fd 2\\n")
    subprocess.run([sys.executable, "-c", "print('from a child process')"], check=True)
    print("path", path, file=sys.stderr, flush=True)
    """
)


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != LOG_DIR_ENV} | env_extra
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True)


def test_capture_sends_python_native_and_child_output_to_the_role_file(tmp_path):
    out = _run({LOG_DIR_ENV: str(tmp_path / "logs")})
    assert out.stdout == "before capture\n" and out.stderr == ""
    text = (tmp_path / "logs" / "trainer-rank3.log").read_text()
    for line in ("python print", "native write to fd 2", "from a child process", "--- trainer-rank3 (pid"):
        assert line in text
    assert "before capture" not in text


def test_without_a_log_dir_output_stays_where_it_was(tmp_path):
    out = _run({})
    assert "python print" in out.stdout and "from a child process" in out.stdout
    assert "native write to fd 2" in out.stderr and "path None" in out.stderr


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm.v1.worker.gpu_model_runner", logging.WARNING, __file__, 1, msg, args, None)


def test_reload_warning_filter_drops_only_the_expert_bookkeeping_message():
    f = ExpertReloadWarningFilter()
    msg = "Following weights were not loaded from checkpoint: %s"
    experts = {
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
        "model.layers.1.mlp.experts.routed_experts.w2_weight",
    }
    assert not f.filter(_record(msg, experts))
    # Any other weight named: the warning stays, experts and all.
    assert f.filter(_record(msg, experts | {"model.layers.0.self_attn.qkv_proj.weight"}))
    assert f.filter(_record("Reloading weights inplace..."))


# A worker that crashes natively after capture(): glibc finds a double free and aborts; faulthandler, which
# capture() enabled, writes every thread's stack into the same file.
CRASH = textwrap.dedent(
    """
    import ctypes, resource, threading, time
    from rl.core.worker_logs import capture
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of this crash where core dumps are on
    capture("trainer-rank0")
    print("step 1 done", flush=True)
    threading.Thread(target=time.sleep, args=(60,), name="waiting", daemon=True).start()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    p = libc.malloc(48)
    libc.free(p)
    libc.free(p)
    """
)


def test_crash_report_is_the_abort_and_every_threads_stack_of_the_last_process(tmp_path):
    # glibc's own allocator (a heap checker preloaded for a stress run would report the double free instead)
    env = {k: v for k, v in os.environ.items() if k not in (LOG_DIR_ENV, "LD_PRELOAD")}
    env[LOG_DIR_ENV] = str(tmp_path / "logs")
    log = tmp_path / "logs" / "trainer-rank0.log"
    crashed = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, env=env)
    assert crashed.returncode == -6  # SIGABRT
    report = crash_report(log)
    assert report.splitlines()[0] == "free(): double free detected in tcache 2"
    assert "Fatal Python error: Aborted" in report
    assert "step 1 done" not in report  # the run's own output before the crash is not part of it
    assert report.count("Thread 0x") + report.count("Current thread 0x") >= 2  # the sleeping thread too
    # The same role's next process appends its part to the file; alive (or killed without a word), that
    # process has no report.
    with log.open("a") as f:
        f.write("--- trainer-rank0 (pid 2) ---\nstep 1 done\n")
    assert crash_report(log) is None
    assert crash_report(tmp_path / "logs" / "missing.log") is None
