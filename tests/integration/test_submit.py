"""`sparkrl submit` against a real local Ray cluster, plus the command it builds (no cluster needed).

The cluster is this test's own: `ray start --head --block` on 127.0.0.1 with free ports and a private
temp dir, in a session of its own, ended by signalling that process (and its process group) at teardown.
`ray stop` is not used: it stops every Ray process of the user on the machine, including other clusters.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rl import submit
from rl.config import ConfigError
from trainer.rendezvous import free_port

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
# Logical CPU slots, not cores: the CPU demo's three actors (2 trainer ranks + 1 rollout engine) take one
# each and mostly wait on each other. The head has 1 and the worker node 2, so a run spans both nodes.
HEAD_CPUS, WORKER_CPUS = 1, 2
WORKER_IP = "127.0.0.2"  # the worker node's own address (all of 127/8 reaches this machine)


def _env_without_ray_address() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}


def _node_ports() -> list[str]:
    """Every port a node opens, free ones: another Ray on this machine holds the defaults it started with,
    and the two nodes here share the machine."""
    names = [
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    ]
    return [f"--{name}={free_port()}" for name in names]


def _active_nodes(gcs: str, env: dict) -> int:
    out = subprocess.run([RAY, "status", f"--address={gcs}"], capture_output=True, text=True, env=env).stdout
    active = out.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in out else ""
    return sum(line.strip().startswith("1 node_") for line in active.splitlines())


@pytest.fixture(scope="module")
def ray_cluster():
    """The dashboard address of a fresh cluster of two nodes, started as launch/README.md shows: the head
    with `launch/head.sh` on 127.0.0.1, a worker node with `launch/worker.sh` on 127.0.0.2 (each
    `BLOCK=1`, in a session of its own, with free ports and a private temp dir).

    Token authentication is on (head.sh's default; the user's ~/.ray/auth_token, created as `ray.init`
    would if missing): Ray's GCS listens on every interface. The client side is what `sparkrl submit` does
    by itself: rl.submit.make_client turns token auth on when the server asks for it, as for a user who
    left RAY_AUTH_MODE unset (tests/conftest.py sets it; it is unset here and put back after, with Ray's
    cached auth state, so that no later test inherits token mode)."""
    auth_env = pytest.MonkeyPatch()
    auth_env.delenv("RAY_AUTH_MODE", raising=False)
    if not any(k in os.environ for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        if not (Path.home() / ".ray" / "auth_token").exists():
            subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True)
    temp = tempfile.mkdtemp(prefix="srl_ray_", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs_port, dash = free_port(), free_port()
    env = {
        **_env_without_ray_address(),
        "RAY_AUTH_MODE": "token",
        "BLOCK": "1",
        "SPARKRL_VENV": str(Path(sys.executable).parents[1]),
    }
    head_env = {**env, "RAY_PORT": str(gcs_port), "DASHBOARD_PORT": str(dash), "NODE_IP": "127.0.0.1"}
    head_cmd = ["launch/head.sh", f"--num-cpus={HEAD_CPUS}", f"--temp-dir={temp}/head"]
    head_cmd += [f"--ray-client-server-port={free_port()}", *_node_ports()]
    worker_cmd = ["launch/worker.sh", f"127.0.0.1:{gcs_port}", f"--num-cpus={WORKER_CPUS}"]
    worker_cmd += [f"--temp-dir={temp}/worker", *_node_ports()]
    procs: list[subprocess.Popen] = []
    logs = []

    def start(cmd, env, name):
        logs.append(open(Path(temp) / f"{name}.log", "w"))
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        )

    def check_alive():
        for proc, name in zip(procs, ("head", "worker")):
            if proc.poll() is not None:
                pytest.fail(f"{name} exited ({proc.returncode}):\n{(Path(temp) / f'{name}.log').read_text()}")

    address = f"http://127.0.0.1:{dash}"
    try:
        start(head_cmd, head_env, "head")
        deadline = time.monotonic() + 180
        while True:
            check_alive()
            try:
                submit.make_client(address)
                break
            except ConnectionError as e:
                if time.monotonic() > deadline:
                    pytest.fail(f"the Ray job server did not come up within 180 s: {e}")
            time.sleep(1)
        start(worker_cmd, {**env, "NODE_IP": WORKER_IP}, "worker")
        while _active_nodes(f"127.0.0.1:{gcs_port}", env) < 2:
            check_alive()
            if time.monotonic() > deadline:
                pytest.fail("the worker node did not join within 180 s")
            time.sleep(1)
        yield address
    finally:
        # SIGTERM lets `ray start --block` shut its node down; then make sure of its process group.
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        for log in logs:
            log.close()
        shutil.rmtree(temp, ignore_errors=True)
        auth_env.undo()
        _reset_ray_auth_state()


def _reset_ray_auth_state() -> None:
    """Ray caches the auth mode and token per process (make_client may have turned token mode on)."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    reset_auth_token_state()


# ----------------------------------------------------------------------------------------------------
# The command submit builds (no cluster)
# ----------------------------------------------------------------------------------------------------


def test_train_command_names_interpreter_and_absolute_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cmd = submit.train_command(
        "recipes/demo_cpu.yaml", ["trainer.total_steps=1"], python="/opt/py/bin/python", working_dir=ROOT
    )
    argv, rdir = cmd.argv, cmd.run_dir
    assert cmd.run_name == "demo_cpu"
    assert argv == [
        "/opt/py/bin/python",
        "-m",
        "rl",
        "train",
        "recipes/demo_cpu.yaml",
        "trainer.total_steps=1",
        f"run.dir={ROOT / 'runs' / 'demo_cpu'}",
    ]
    assert rdir == ROOT / "runs" / "demo_cpu"

    cmd = submit.train_command(
        "demo_cpu", ["run.name=x/y"], runs_root=tmp_path, working_dir=ROOT, resume=True
    )
    argv, rdir = cmd.argv, cmd.run_dir
    assert argv[4] == "recipes/demo_cpu.yaml"  # a shipped recipe's name, found inside the upload
    assert argv[-2:] == [f"run.dir={tmp_path / 'x' / 'y'}", "--resume"]
    assert rdir == tmp_path / "x" / "y"


def test_train_command_recipe_outside_upload_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text("{}\n")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text((ROOT / "recipes" / "demo_cpu.yaml").read_text())
    argv = submit.train_command(str(recipe), ["data.train=data.jsonl?limit=4"], working_dir=ROOT).argv
    assert argv[4] == str(recipe)  # not uploaded: passed as an absolute path
    assert f"data.train={tmp_path / 'data.jsonl'}?limit=4" in argv
    assert f"run.dir={tmp_path / 'runs' / 'demo_cpu'}" == argv[-1]


def test_each_local_path_is_named_as_the_job_finds_it(tmp_path, monkeypatch):
    """The job runs in Ray's copy of the working directory: what the upload carries (Ray's own walk decides,
    the project's .gitignore included) is named relative to it, whatever directory submit ran from; what it
    leaves out (ignored data, excluded weights) is named absolute, with a note."""
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "sub").mkdir()
    (proj / ".gitignore").write_text("data/\n")
    (proj / "data" / "train.jsonl").write_text("{}\n")
    (proj / "eval.jsonl").write_text("{}\n")
    (proj / "reward.py").write_text("def score(**kw):\n    return 0.0\n")
    (proj / "model").mkdir()
    (proj / "model" / "config.json").write_text("{}")
    (proj / "model" / "model.safetensors").write_bytes(b"w")
    recipe = proj / "r.yaml"
    recipe.write_text((ROOT / "recipes" / "demo_cpu.yaml").read_text())
    monkeypatch.chdir(proj / "sub")  # not the working directory
    cmd = submit.train_command(
        str(recipe),
        [
            "data.train=../data/train.jsonl",
            "eval.data=../eval.jsonl?limit=4",
            "reward.function=../reward.py:score",
            "model.make_tiny.arch=",
            "model.path=../model",
            "logging.mlflow_tracking_uri=sqlite:///mlflow.db",
        ],
        working_dir=proj,
    )
    argv = cmd.argv
    assert argv[4] == "r.yaml"
    assert "eval.data=eval.jsonl?limit=4" in argv and "reward.function=reward.py:score" in argv
    assert f"data.train={proj / 'data' / 'train.jsonl'}" in argv  # .gitignore'd: not uploaded
    assert f"model.path={proj / 'model'}" in argv  # its weights are excluded
    assert f"logging.mlflow_tracking_uri=sqlite:///{proj / 'sub' / 'mlflow.db'}" in argv
    assert [n.split(":")[0] for n in cmd.notes] == ["model.path", "data.train"]
    assert "which the cluster's nodes must see" in cmd.notes[0]


def test_bad_override_fails_before_submitting(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match="trainer.lrr"):
        submit.train_command("recipes/demo_cpu.yaml", ["trainer.lrr=1"])
    args = argparse.Namespace(
        recipe="recipes/demo_cpu.yaml",
        overrides=["trainer.total_steps=0"],
        working_dir=None,
        env=[],
        python=sys.executable,
        runs_root=None,
        address="http://127.0.0.1:1",
        no_wait=True,
        resume=False,
    )
    assert submit.main(args) == 2  # config error: no connection attempted (port 1 would refuse)


def test_unreachable_cluster_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = argparse.Namespace(
        recipe="recipes/demo_cpu.yaml",
        overrides=[],
        working_dir=None,
        env=[],
        python=sys.executable,
        runs_root=None,
        address="http://127.0.0.1:1",
        no_wait=True,
        resume=False,
    )
    assert submit.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparkrl submit: cannot reach the Ray job server at http://127.0.0.1:1")
    assert "RAY_ADDRESS" in err


def test_runtime_env_and_uploads():
    renv = submit.runtime_env(ROOT, {"A": "1"})
    assert renv["working_dir"] == str(ROOT)
    assert renv["env_vars"] == {"PYTHONUNBUFFERED": "1", "SPARKRL_SUBMITTED": "1", "A": "1"}
    assert {".venv", "runs", ".git"} <= set(renv["excludes"])
    assert submit.is_uploaded(ROOT / "recipes" / "demo_cpu.yaml", ROOT)
    assert not submit.is_uploaded(ROOT / "runs" / "x" / "config.yaml", ROOT)
    assert not submit.is_uploaded(ROOT / ".venv" / "bin" / "python", ROOT)
    assert submit.parse_env(["X=1", "Y=a=b"]) == {"X": "1", "Y": "a=b"}
    with pytest.raises(ValueError, match="not set"):
        submit.parse_env(["SPARKRL_SURELY_UNSET_VAR"])


def test_submission_id_is_url_safe():
    sid = submit.submission_id("demo_lr_clip/lr=1e-4,clip=0.2")
    assert sid.startswith("sparkrl-demo_lr_clip_lr_1e-4_clip_0_2-")
    assert "/" not in sid and "," not in sid


# ----------------------------------------------------------------------------------------------------
# Against the cluster
# ----------------------------------------------------------------------------------------------------


def test_submit_trivial_entrypoint_follows_logs(ray_cluster):
    client = submit.make_client(ray_cluster)
    # The job runs in the uploaded checkout: prove it by importing rl from there and printing its cwd.
    code = (
        "import os, rl; print('hello from', os.path.basename(os.path.dirname(rl.__file__))); "
        "print(os.getcwd())"
    )
    job_id = submit.submit_entrypoint(client, shlex.join([sys.executable, "-c", code]), job_id="srl-hello")
    assert job_id == "srl-hello"
    out = io.StringIO()
    assert submit.follow(client, job_id, out=out) == "SUCCEEDED"
    lines = out.getvalue().splitlines()
    assert "hello from rl" in lines
    cwd = lines[lines.index("hello from rl") + 1]
    assert cwd != str(ROOT) and "working_dir_files" in cwd  # Ray's unpacked copy, not this checkout

    failing = submit.submit_entrypoint(client, shlex.join([sys.executable, "-c", "import sys; sys.exit(3)"]))
    assert submit.wait(client, failing, poll_s=0.5, timeout_s=120) == "FAILED"


def test_submit_command_no_wait_then_wait(ray_cluster, tmp_path, monkeypatch, capsys):
    """The `submit` subcommand through its register(): a config-checked job whose entrypoint runs; the job
    fails or succeeds with `train`, but its id is printed and its status is final."""
    parser = argparse.ArgumentParser(prog="sparkrl")
    submit.register(parser.add_subparsers(dest="command"))
    monkeypatch.chdir(ROOT)
    args = parser.parse_args(
        [
            "submit",
            "recipes/demo_cpu.yaml",
            "trainer.total_steps=1",
            "--no-wait",
            "--address",
            ray_cluster,
            "--runs-root",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    job_id = out.split("submit: job ", 1)[1].split()[0]
    assert f"submit: run dir {tmp_path / 'demo_cpu'}" in out
    assert f"run.dir={tmp_path / 'demo_cpu'}" in out
    info = submit.make_client(ray_cluster).get_job_info(job_id)
    assert info.entrypoint.startswith(f"{sys.executable} -m rl train recipes/demo_cpu.yaml")
    assert info.metadata["sparkrl_run_dir"] == str(tmp_path / "demo_cpu")
    submit.make_client(ray_cluster).stop_job(job_id)  # its result is the slow test's business
    final = submit.wait(submit.make_client(ray_cluster), job_id, timeout_s=120)
    assert final in ("STOPPED", "FAILED", "SUCCEEDED")


@pytest.mark.slow
def test_sweep_through_submit_trains_every_point(ray_cluster, tmp_path, monkeypatch, capsys, one_step_sweep):
    """`sparkrl sweep` without --local: a 2-point grid of the CPU demo, one Ray job a point on the two-node
    cluster, each training for real under its point's name (`rs/lr=...`: a slash, which each node's
    rollout workers stage under a name of their own); then the table and the side-by-side report. The
    workers' logs (one a worker, each naming its node) show that a run spanned both nodes."""
    from rl import sweep as S

    sweep_file = one_step_sweep(tmp_path / "s.yaml", "rs")
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    parser = argparse.ArgumentParser(prog="sparkrl")
    S.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["sweep", str(sweep_file), "--address", ray_cluster, "--runs-root", str(tmp_path / "runs")]
    )
    assert args.func(args) == 0, capsys.readouterr().out[-4000:]
    out = capsys.readouterr().out
    assert out.count(": SUCCEEDED") == 2
    runs = [tmp_path / "runs" / "rs" / "lr=0.001", tmp_path / "runs" / "rs" / "lr=0.004"]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(str(tmp_path))}
    assert set(rows) == {str(r) for r in runs}
    assert all(row[1] == "1" and row[-1] == "ok" for row in rows.values())
    for run in runs:
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
        assert (run / "rollouts" / "step_1.jsonl").is_file()
    report = (tmp_path / "runs" / "rs" / "report" / "report.md").read_text()
    assert "rs/lr=0.001" in report and "rs/lr=0.004" in report
    heads = [p.read_text().splitlines()[0] for p in (runs[0] / "logs").glob("*.log")]
    nodes = {h.rsplit("node ", 1)[1].rstrip(" -)") for h in heads if "node " in h}
    # the head reports the machine's routable address (Ray's choice for 127.0.0.1), the worker its own
    assert len(nodes) == 2 and WORKER_IP in nodes, heads


class _AgentNotUpClient:
    """Answers as Ray's job server does while a fresh head's job agent has not registered yet, `misses`
    times, then accepts. A fake: that window lasts a few seconds on a real cluster and cannot be held
    open on purpose."""

    def __init__(self, misses: int):
        self.misses, self.calls = misses, 0

    def submit_job(self, **kwargs):
        self.calls += 1
        if self.calls <= self.misses:
            raise RuntimeError(
                "Request failed with status code 500: No available agent to submit job, please try again later."
            )
        return "job-1"


def test_submit_waits_for_a_fresh_clusters_job_agent(monkeypatch):
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    client = _AgentNotUpClient(misses=3)
    assert submit.submit_entrypoint(client, "true", renv={}) == "job-1"
    assert client.calls == 4


def test_submit_gives_up_on_a_job_agent_that_never_comes(monkeypatch):
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    monkeypatch.setattr(submit, "AGENT_WAIT_S", 0.0)
    with pytest.raises(RuntimeError, match="job agent did not come up within 0 s"):
        submit.submit_entrypoint(_AgentNotUpClient(misses=10**6), "true", renv={})


def test_submit_does_not_retry_other_errors(monkeypatch):
    class Refusing:
        calls = 0

        def submit_job(self, **kwargs):
            self.calls += 1
            raise RuntimeError("Request failed with status code 400: bad runtime_env")

    client = Refusing()
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        submit.submit_entrypoint(client, "true", renv={})
    assert client.calls == 1
