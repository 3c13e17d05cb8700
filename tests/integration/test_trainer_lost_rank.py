"""TrainerGroup's gather of one call a rank when ranks fail, on a real local Ray instance.

The ranks are stand-in actors (one method that returns, raises, hangs, kills its own process or crashes it
with a segfault, after a delay): the orders of events here are the ones a real run leaves to timing. A
survivor's collective error ("Connection reset by peer") may reach the driver before Ray reports its peer's
death, or after it; a live rank may raise while another waits forever in a collective. A real rank lost
with its node is test_train_e2e.py's.
"""

from __future__ import annotations

import ctypes
import os
import resource
import time

import pytest

from rl.core.worker_logs import capture, stderr_path
from trainer import group as group_module
from trainer.group import TrainerGroup, TrainerRankLost

NODES = [("node-a", "10.0.0.1"), ("node-b", "10.0.0.2")]


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class StandInRank:
        def __init__(self):
            capture("trainer-rank")  # as TrainerWorker starts: no run log dir here, so faulthandler alone

        def output(self):
            return stderr_path()  # Ray's log of this worker

        def call(self, behaviour: str, delay_s: float):
            time.sleep(delay_s)
            if behaviour == "die":
                os._exit(1)
            if behaviour == "crash":  # a read of address 0: SIGSEGV (no core file of it where cores are on)
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                ctypes.string_at(0)
            if behaviour == "hang":
                time.sleep(3600)
            if behaviour == "raise":
                raise RuntimeError("gloo: Read error: Connection reset by peer")
            if behaviour == "bad input":
                raise ValueError("sample 3: 9000 tokens, more than trainer.max_seq_len")
            return behaviour

    def make(n: int = 2) -> TrainerGroup:
        g = TrainerGroup.__new__(TrainerGroup)  # the gather alone: no trainer ranks are built
        g.workers, g.nodes, g.broken = [StandInRank.remote() for _ in range(n)], NODES[:n], False
        g.outputs = ray.get([w.output.remote() for w in g.workers])
        return g

    return make


def _calls(g: TrainerGroup, *plan: tuple[str, float]):
    return [w.call.remote(behaviour, delay) for w, (behaviour, delay) in zip(g.workers, plan)]


def test_results_come_back_in_rank_order(ranks):
    g = ranks()
    assert g._get(_calls(g, ("first", 0.5), ("second", 0.0))) == ["first", "second"]
    assert not g.broken


def test_a_survivors_collective_error_first_still_names_the_dead_rank(ranks):
    g = ranks()
    start = time.monotonic()
    with pytest.raises(TrainerRankLost) as lost:
        g._get(_calls(g, ("raise", 0.0), ("die", 1.0)))
    assert lost.value.rank == 1 and lost.value.node_ip == "10.0.0.2" and lost.value.node_id == "node-b"
    assert "trainer rank 1 on node 10.0.0.2 (node id node-b) was lost" in str(lost.value)
    assert g.broken and time.monotonic() - start < group_module.LOST_RANK_GRACE_S


def test_a_dead_rank_is_reported_while_the_other_waits_in_its_collective(ranks):
    g = ranks()
    with pytest.raises(TrainerRankLost) as lost:
        g._get(_calls(g, ("hang", 0.0), ("die", 0.0)))
    assert lost.value.rank == 1 and g.broken


def test_a_rank_that_crashed_is_reported_with_its_signal_and_stacks(ranks):
    """A native crash in a rank (here a segfault): the lost rank's message names the rank's output file
    (Ray's log of the worker) and carries what the crash wrote there, faulthandler's stack of every thread,
    so a crash in CI explains itself in the test's output. (A glibc abort's line: test_worker_logs.py.)"""
    g = ranks()
    with pytest.raises(TrainerRankLost) as lost:
        g._get(_calls(g, ("hang", 0.0), ("crash", 0.0)))
    message = str(lost.value)
    assert lost.value.rank == 1 and f"(its output: {g.outputs[1]}; it crashed:" in message
    assert g.outputs[1].endswith(".err") and "worker-" in g.outputs[1]
    report = message.split("it crashed:\n")[1]
    # Ray's handler prints the native stack and passes the signal on to faulthandler: every thread's Python
    # stack, the stand-in's frame among them
    assert 0 <= report.find("*** SIGSEGV received") < report.find("Fatal Python error: Segmentation fault")
    assert "in call" in report


def test_a_live_ranks_error_is_raised_once_the_grace_is_over(ranks, monkeypatch):
    """No rank died, one waits forever: the first error, after LOST_RANK_GRACE_S, and the group is broken
    (shutdown kills its ranks rather than wait for the one stuck)."""
    monkeypatch.setattr(group_module, "LOST_RANK_GRACE_S", 2.0)
    g = ranks()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection reset by peer") as raised:
        g._get(_calls(g, ("raise", 0.0), ("hang", 0.0)))
    assert not isinstance(raised.value, TrainerRankLost)
    assert 2.0 <= time.monotonic() - start < 30 and g.broken


def test_an_error_every_rank_raises_together_leaves_the_group_usable(ranks):
    """As TrainerWorker._agree does for bad input: every call ended, so no rank is stuck."""
    g = ranks()
    with pytest.raises(ValueError, match="trainer.max_seq_len"):
        g._get(_calls(g, ("bad input", 0.0), ("bad input", 0.2)))
    assert not g.broken
    assert g._get(_calls(g, ("again", 0.0), ("again", 0.0))) == ["again", "again"]
