"""Ray started or joined on purpose, and no silent wait for resources: on real Ray clusters.

A second cluster runs beside the test (`ray start --head` on free ports, its session files in a temporary
RAY_TMPDIR so that its `ray_current_cluster` is the one this test's Ray finds), the way a cluster left
running on a shared machine would. Only that cluster is stopped at the end (its own `ray start --block`
process), never others on the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rl.config import load_config
from rl.core import resource_wait
from rl.core.resource_wait import ResourceWaitTimeout
from rl.preflight import PreflightError
from rl.setup import init_ray, waiting_for_resources
from trainer.rendezvous import free_port

RAY = str(Path(sys.executable).with_name("ray"))


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def _cfg(*overrides):
    return load_config("demo_cpu", ["logging.tensorboard=false", *overrides])


@pytest.fixture(scope="module")
def other_cluster():
    """(address, RAY_TMPDIR) of a 2-CPU Ray cluster that this test did not start its run on. Its token auth
    is off by name: `ray start` turns it on whenever ~/.ray/auth_token exists, which a local `ray.init()`
    in an earlier test writes, and this process's Ray would not send the token (its mode is fixed at its
    first init)."""
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    cmd = [
        RAY,
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=2",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=false",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        "--disable-usage-stats",
    ]
    log = open(Path(tmp) / "ray_start.log", "w")
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    current = Path(tmp) / "ray" / "ray_current_cluster"
    try:
        deadline = time.monotonic() + 300
        while not (current.exists() and current.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start failed: {(Path(tmp) / 'ray_start.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", tmp
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes of its own node
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def no_ray_address(monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield
    ray.shutdown()


def test_without_an_address_a_run_starts_its_own_instance(other_cluster, no_ray_address, monkeypatch, capsys):
    """A bare ray.init() here would join the other cluster (named in ray_current_cluster) and refuse
    num_cpus; the run starts its own instead and says so."""
    import ray

    address, tmp = other_cluster
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    assert init_ray(_cfg()) is True
    assert "ray: started a local instance for this run" in capsys.readouterr().out
    assert _port(ray.get_runtime_context().gcs_address) != _port(address)
    assert ray.cluster_resources()["CPU"] == max(os.cpu_count() or 1, 4)  # not the other cluster's 2


def test_a_stale_ray_current_cluster_is_ignored(no_ray_address, monkeypatch, capsys):
    import ray

    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    try:
        (Path(tmp) / "ray").mkdir()
        (Path(tmp) / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}\n")  # nobody there
        monkeypatch.setenv("RAY_TMPDIR", tmp)
        assert init_ray(_cfg()) is True
        assert "started a local instance" in capsys.readouterr().out
        assert ray.cluster_resources()["CPU"] >= 3
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def test_with_an_address_a_run_joins_and_checks_the_cluster(other_cluster, no_ray_address, capsys):
    import ray

    address, _ = other_cluster
    # The demo's 2 trainer ranks + 1 rollout engine need 3 CPU slots; the cluster has 2.
    with pytest.raises(PreflightError) as e:
        init_ray(_cfg(f"resources.ray_address={address}"))
    assert e.value.problems[0].startswith("trainer.num_ranks: the run's workers need 3 CPU slots, but the")
    assert "has 2 CPU slots, 0 GPUs on 1 node(s)" in e.value.problems[0]
    assert not ray.is_initialized()

    assert init_ray(_cfg(f"resources.ray_address={address}", "trainer.num_ranks=1")) is True
    gcs = ray.get_runtime_context().gcs_address  # the node's own IP, however it was reached
    assert _port(gcs) == _port(address)
    assert (
        f"ray: joined the cluster at {gcs} ({address}): 2 CPU slots, 0 GPUs, 1 node(s)"
        in capsys.readouterr().out
    )


def test_waiting_for_resources_is_reported_and_bounded(other_cluster, no_ray_address):
    """Three one-CPU actors on the 2-CPU cluster: the third waits; the wait is reported every
    resources.wait_report_s and given up after resources.wait_timeout_s."""
    import ray

    address, _ = other_cluster
    ray.init(address=address)

    @ray.remote(num_cpus=1)
    class Probe:
        def ping(self):
            return 1

        def wait(self, seconds):
            time.sleep(seconds)
            return seconds

    cfg = _cfg("resources.wait_report_s=0.5", "resources.wait_timeout_s=2")
    lines: list[str] = []
    actors = []
    with pytest.raises(ResourceWaitTimeout) as e:
        with waiting_for_resources(cfg, "the probes", out=lines.append):
            actors = [Probe.remote() for _ in range(3)]
            resource_wait.get([a.ping.remote() for a in actors])  # what RolloutPool and TrainerGroup call
    msg = str(e.value)
    assert msg.startswith("resources.wait_timeout_s: the probes waited")
    assert re.search(r"pending 1 \S*Probe actor", msg)
    assert "the cluster has {CPU: 2} on 1 node(s), free {CPU: 0}" in msg
    assert "unmet demands 1 x {CPU: 1}" in msg  # as `ray status` shows it
    assert lines and all(line.startswith("resources: the probes waiting") for line in lines)
    for a in actors:
        ray.kill(a)

    # Nothing pending (a slow start, not a wait for resources): silent, and no timeout however long. An
    # actor whose constructor runs (a vLLM engine loading its weights) is still PENDING_CREATION to Ray.
    @ray.remote(num_cpus=1)
    class SlowStart:
        def __init__(self, seconds):
            time.sleep(seconds)

        def ping(self):
            return 1

    slow = Probe.remote()
    assert ray.get(slow.ping.remote()) == 1  # placed before the block
    lines.clear()
    with waiting_for_resources(cfg, "the slow one", out=lines.append):
        assert resource_wait.get(slow.wait.remote(3.0)) == 3.0
        starting = SlowStart.remote(4.0)  # held: an actor without a handle is cancelled
        assert resource_wait.get(starting.ping.remote()) == 1
    assert lines == []
