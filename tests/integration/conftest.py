"""Shared by the GRPO run tests (test_train_e2e.py, test_train_runs.py): a small demo config, a local Ray
instance a module, and a Ray cluster of two CPU nodes a module."""

from __future__ import annotations

import pytest

from rl.config import load_config

SMALL = [
    "data.train_batch_size=4",
    "rollout.n=4",
    "data.arith.eval_rows=8",
    "eval.k=4",
    "eval.every=2",
    "logging.tensorboard=false",
]


# The nodes of `two_node_cluster`: addresses of their own (all of 127/8 reaches this machine), as two machines.
NODE_CPUS = {"127.0.0.2": 1, "127.0.0.3": 2}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for the module, on this machine alone."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)  # never another cluster on the machine
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def two_node_cluster():
    """A Ray cluster on this machine for the module: the driver's head node with no CPUs, and two nodes of
    1 and 2 CPUs at their own loopback addresses (NODE_CPUS). A run's three actors (two trainer ranks,
    one rollout engine) cannot fit on one node, so every run here spans two, as it would two machines.
    -> the node addresses."""
    import shutil
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="sprk-", dir="/tmp")  # short: Ray's socket paths live under it
    env = pytest.MonkeyPatch()
    env.setenv("RAY_TMPDIR", tmp)  # `ray.init("auto")` elsewhere never finds this cluster
    common = {"include_dashboard": False, "dashboard_agent_listen_port": None, "temp_dir": f"{tmp}/ray"}
    c = Cluster(initialize_head=True, head_node_args={**common, "num_cpus": 0})
    try:
        for ip, cpus in NODE_CPUS.items():
            c.add_node(**common, num_cpus=cpus, node_ip_address=ip)
        c.wait_for_nodes()
        c.connect()
        yield set(NODE_CPUS)
    finally:
        ray.shutdown()
        c.shutdown()
        env.undo()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def small_demo_config():
    """make(directory, name, extra overrides): the demo recipe on batches of 4 prompts x 4 samples, an
    8-problem evaluation every 2 steps, run in directory/name."""

    def make(directory, name, extra=()):
        return load_config("demo_cpu", [f"run.name={name}", f"run.dir={directory / name}", *SMALL, *extra])

    return make
