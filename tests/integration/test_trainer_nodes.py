"""Trainer ranks on two Ray nodes meet at the address Ray reports for rank 0's node.

The cluster is real Ray (`ray.cluster_utils.Cluster`): a head node with no CPUs (the driver's, where no
rank can go) and two nodes of one CPU each that Ray knows by their own loopback addresses, 127.0.0.2 and
127.0.0.3 (on Linux all of 127/8 reaches this machine), so each rank lands on its own node and every node
has an address of its own, as on two machines. The rendezvous address the group picks must be rank 0's
node's; the driver's address would be the wrong one on two machines. The ranks sit in a placement group
the group reserves and removes at shutdown."""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from trainer.config import LoraConfig, TrainerConfig
from trainer.group import TrainerGroup
from trainer.spec import TrainerSpec
from trainer.testing import random_samples

NODES = ("127.0.0.2", "127.0.0.3")


@pytest.fixture
def two_nodes(monkeypatch):
    tmp = tempfile.mkdtemp(prefix="sprk-", dir="/tmp")  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    common = {"include_dashboard": False, "dashboard_agent_listen_port": None, "temp_dir": f"{tmp}/ray"}
    c = Cluster(initialize_head=True, head_node_args={**common, "num_cpus": 0})
    try:
        for ip in NODES:
            c.add_node(**common, num_cpus=1, node_ip_address=ip)
        c.wait_for_nodes()
        c.connect()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def test_ranks_on_two_nodes_meet_at_rank0s_node_address(two_nodes, tiny_moe_path):
    spec = TrainerSpec(
        model_path=str(tiny_moe_path),
        dtype="float32",
        lora=LoraConfig(rank=8, alpha=16.0),
        trainer=TrainerConfig(
            lr=1e-3, micro_batch_tokens=0, micro_batch_size=2, activation_checkpointing=False, compile=False
        ),
        optimizer_steps=1,
        max_seq_len=32,
    )
    group = TrainerGroup(spec, 2, placement_group_name="ranks")
    try:
        where = ray.get(
            [w.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()) for w in group.workers]
        )
        assert sorted(where) == sorted(NODES)  # one rank a node: each node has one CPU
        assert group.master_addr == where[0] != ray.util.get_node_ip_address()
        logp, metrics = group.log_probs(random_samples(4, seed=3))  # the gloo group works across them
        assert len(logp) == 4 and all(np.isfinite(v).all() and (v < 0).all() for v in logp)
        assert metrics["actor/entropy"] > 0
        # Each rank in a bundle the group reserved for it before any rank started.
        assert [t["state"] for t in _groups("ranks")] == ["CREATED"]
    finally:
        group.shutdown()
    assert [t["state"] for t in _groups("ranks")] == ["REMOVED"]  # its slots free for the next group
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def _groups(name: str) -> list[dict]:
    from ray.util import placement_group_table

    return [t for t in placement_group_table().values() if t["name"] == name]
