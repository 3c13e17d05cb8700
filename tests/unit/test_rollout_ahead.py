"""The asynchronous loop's bookkeeping (rl/rollout_ahead.py, trainer/versions.py) on plain Python and torch:
which version generates which step's batch, the order of loads and batches on the rollout thread, the
loader state a checkpoint saves and a regeneration rewinds to, and the trainer's kept adapter versions.
The rollout here is a function that records what it was asked (the real engines run in the GRPO tests)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rl.rollout_ahead import RolloutAhead
from trainer.versions import AdapterVersions


class Loader:
    """A prompt loader's state: how many prompts it handed out."""

    def __init__(self):
        self.pos = 0

    def next_batch(self, n):
        out = list(range(self.pos, self.pos + n))
        self.pos += n
        return out

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Engines:
    """Records every load and batch in the order the rollout thread ran them."""

    def __init__(self, loader, seconds=0.0):
        self.loader, self.seconds, self.version, self.calls = loader, seconds, 0, []
        self.threads = set()

    def load(self, weights, version):
        assert weights == f"w{version}"
        self.version = version
        self.calls.append(("load", version))
        return {"perf/sync_bytes": 1.0}

    def collect(self, step, metrics):
        self.threads.add(threading.get_ident())
        time.sleep(self.seconds)
        prompts = self.loader.next_batch(2)
        self.calls.append(("batch", step, self.version, tuple(prompts)))
        return prompts, self.seconds, 0


def _ahead(k, seconds=0.0):
    loader = Loader()
    engines = Engines(loader, seconds)
    ahead = RolloutAhead(k, engines.collect, engines.load, loader)
    ahead.publish(0, "w0")
    return ahead, engines, loader


def _run(ahead, steps):
    """The driver's order: fill, take, (update), publish the new version. -> each step's batch version."""
    got = []
    for step in range(1, steps + 1):
        ahead.fill(min(steps, step + ahead.k), step - 1)
        batch, (prompts, _, _, _) = ahead.take(step)
        got.append(batch.version)
        ahead.publish(step, f"w{step}")
    return got


@pytest.mark.parametrize("k,versions", [(1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2]), (4, [0, 0, 0, 0, 0])])
def test_batch_j_is_generated_by_version_j_minus_1_minus_k(k, versions):
    ahead, engines, _ = _ahead(k)
    try:
        assert _run(ahead, 5) == versions
        # each load lands before the first batch that needs it, never between a batch's draws
        batches = [c for c in engines.calls if c[0] == "batch"]
        assert [(c[1], c[2]) for c in batches] == list(zip(range(1, 6), versions))
        loads = [c[1] for c in engines.calls if c[0] == "load"]
        assert loads == sorted(set(versions) - {0})
        assert len(engines.threads) == 1 and threading.get_ident() not in engines.threads
    finally:
        ahead.close()


def test_fill_waits_for_the_version_a_batch_needs():
    ahead, _, _ = _ahead(1)
    try:
        ahead.fill(10, trained_version=0)  # steps 1 and 2 need version 0; step 3 needs 1
        assert [b.step for b in ahead.pending] == [1, 2]
        with pytest.raises(RuntimeError, match="step 2's batch was not submitted"):
            ahead.take(2)
    finally:
        ahead.close()


def test_a_batch_generated_again_draws_its_own_prompts_at_its_version():
    ahead, engines, loader = _ahead(1)
    try:
        ahead.fill(3, 0)
        first, (prompts, *_) = ahead.take(1)
        ahead.publish(1, "w1")
        ahead.fill(3, 1)  # step 3 at version 1 queued behind step 2
        redo, (again, *_) = ahead.again(first)  # e.g. its routing was lost with its node
        assert again == prompts and redo.version == 0 and engines.version == 0
        assert loader.pos == 6  # the three batches' prompts handed out once each: the loader is back
        assert engines.calls[-1] == ("batch", 1, 0, tuple(prompts))
        assert ("load", 1) in engines.calls  # step 3 ran at version 1 before the regeneration reloaded 0
    finally:
        ahead.close()


def test_the_checkpointed_loader_state_is_before_the_oldest_batch_in_flight():
    ahead, _, loader = _ahead(1)
    try:
        ahead.fill(5, 0)
        ahead.take(1)
        assert ahead.loader_state() == {
            "pos": 2
        }  # step 2's batch drew prompts 2-3: a resume draws them again
        ahead.take(2)
        assert ahead.loader_state() == {"pos": 4} == loader.state_dict()  # nothing in flight
    finally:
        ahead.close()


def test_evaluation_runs_after_the_queued_batches_on_the_finished_version():
    ahead, engines, _ = _ahead(1, seconds=0.05)
    try:
        ahead.fill(2, 0)
        ahead.take(1)
        ahead.publish(1, "w1")
        seen = ahead.at_version(1, lambda: (engines.version, list(engines.calls)))
        assert seen[0] == 1 and seen[1][-2:] == [("batch", 2, 0, (2, 3)), ("load", 1)]
    finally:
        ahead.close()


def test_the_next_batch_is_generated_while_the_step_trains():
    ahead, _, _ = _ahead(1, seconds=0.3)
    try:
        ahead.fill(2, 0)
        ahead.take(1)
        start = time.perf_counter()
        time.sleep(0.2)  # the update of step 1, on the driver's thread
        assert ahead.overlap_s(start, time.perf_counter()) > 0.1
    finally:
        ahead.close()


def test_publish_keeps_the_versions_a_batch_can_still_need():
    ahead, _, _ = _ahead(2)
    for v in range(1, 6):
        ahead.publish(v, f"w{v}")
    assert sorted(ahead.weights) == [3, 4, 5]
    ahead.close()


def test_trainer_versions_swap_in_and_back():
    p = torch.nn.Parameter(torch.zeros(3))
    versions = AdapterVersions([p], keep=1)
    for v in range(3):  # update v -> v + 1 adds 1 to every weight
        versions.save(v)
        with torch.no_grad():
            p.add_(1.0)
    assert versions.versions() == [2]  # current 3, one older kept
    with versions.at(2, current=3):
        assert p.tolist() == [2.0, 2.0, 2.0]
    assert p.tolist() == [3.0, 3.0, 3.0]
    with versions.at(None, current=3):
        assert p.tolist() == [3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match=r"adapter version 1 is not kept \(current 3, kept \[2\]\)"):
        with versions.at(1, current=3):
            pass
    assert p.tolist() == [3.0, 3.0, 3.0]
    none_kept = AdapterVersions([p], keep=0)
    none_kept.save(3)
    assert none_kept.versions() == []
