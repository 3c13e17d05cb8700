"""Shared by the GRPO run tests (test_train_e2e.py, test_train_runs.py): a small demo config, a local Ray
instance a module, and a Ray cluster of one-CPU nodes a module that tests can take nodes from; and, for
the sweep tests, a sweep file of one-step demo runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "data.train_batch_size=4",
    "rollout.n=4",
    "data.arith.eval_rows=8",
    "eval.k=4",
    "eval.every=2",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for the module, on this machine alone."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)  # never another cluster on the machine
    yield
    ray.shutdown()


# `node_cluster`'s nodes: one CPU each, at addresses of their own (all of 127/8 reaches this machine), as
# separate machines; the spares join when a test adds a node.
NODE_IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
SPARE_IPS = ("127.0.0.5", "127.0.0.6", "127.0.0.7")


class NodeCluster:
    """A Ray cluster of one-CPU nodes on this machine (ray.cluster_utils.Cluster) that a test can take nodes
    from and add nodes to. One CPU a node: each worker of a run (a trainer rank, a rollout engine) has a
    node of its own, so a lost node loses exactly that worker. As on machines of their own, each node has
    a directory of its own (`node_dir(ip)`): its raylet, and so its workers, run there, and it is their
    SPARKRL_STAGE_DIR, where they stage weights (a machine's own /dev/shm)."""

    def __init__(self, cluster, node_args: dict, node_dirs: Path):
        self.cluster, self.node_args, self.nodes = cluster, node_args, {}
        self.spares = list(SPARE_IPS)
        self.node_dirs = node_dirs

    def node_dir(self, ip: str) -> Path:
        return self.node_dirs / ip

    def add(self, ip: str | None = None) -> str:
        import contextlib

        from rollout.staging import STAGE_DIR_ENV

        ip = ip or self.spares.pop(0)
        self.node_dir(ip).mkdir(parents=True, exist_ok=True)
        with contextlib.chdir(self.node_dir(ip)):  # the raylet's working directory, and so its workers'
            self.nodes[ip] = self.cluster.add_node(
                **self.node_args,
                num_cpus=1,
                node_ip_address=ip,
                env_vars={STAGE_DIR_ENV: str(self.node_dir(ip))},
            )
        self.cluster.wait_for_nodes()
        return ip

    def kill(self, ip: str) -> None:
        """The node's raylet and every Ray process on it, SIGKILLed: as a machine that drops out."""
        self.cluster.remove_node(self.nodes.pop(ip), allow_graceful=False)


@pytest.fixture(scope="module")
def node_cluster():
    """A Ray cluster on this machine for the module: the driver's head node with no CPUs, and one-CPU nodes
    at NODE_IPS (NodeCluster). A run's three actors (two trainer ranks, one rollout engine) take one node
    each, so every run spans three, as it would three machines."""
    import shutil
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="sprk-", dir="/tmp")  # short: Ray's socket paths live under it
    env = pytest.MonkeyPatch()
    env.setenv("RAY_TMPDIR", tmp)  # `ray.init("auto")` elsewhere never finds this cluster
    common = {"include_dashboard": False, "dashboard_agent_listen_port": None, "temp_dir": f"{tmp}/ray"}
    # A killed node is declared dead after 3 missed health checks of 0.5 s (Ray's default: 5 of 3 s).
    health = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    c = Cluster(initialize_head=True, head_node_args={**common, "num_cpus": 0, "_system_config": health})
    try:
        nodes = NodeCluster(c, common, Path(tmp) / "nodes")
        for ip in NODE_IPS:
            nodes.add(ip)
        c.connect()
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()
        env.undo()
        shutil.rmtree(tmp, ignore_errors=True)


# One small step of the CPU demo a run, for tests of the paths a run takes (jobs, sweeps), not its learning.
ONE_STEP_DEMO = {
    "trainer.total_steps": 1,
    "data.train_batch_size": 4,
    "rollout.n": 4,
    "eval.every": 0,
    "eval.at_start": False,
    "trainer.checkpoint_every": 0,
    "logging.tensorboard": False,
}


@pytest.fixture(scope="session")
def one_step_demo() -> list[str]:
    """ONE_STEP_DEMO as `key=value` overrides of a command line."""
    return [f"{k}={json.dumps(v)}" for k, v in ONE_STEP_DEMO.items()]


@pytest.fixture(scope="session")
def one_step_sweep():
    """write(path, name): a sweep file of the CPU demo (absolute base) at `path` named `name`, ONE_STEP_DEMO
    for every run and a grid of two learning rates: runs `<name>/lr=0.001` and `<name>/lr=0.004`."""

    def write(path: Path, name: str) -> Path:
        overrides = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in ONE_STEP_DEMO.items())
        path.write_text(
            f"base: {ROOT / 'recipes' / 'demo_cpu.yaml'}\nname: {name}\noverrides:\n{overrides}"
            "grid: {trainer.lr: [1.0e-3, 4.0e-3]}\n"
        )
        return path

    return write


@pytest.fixture(scope="session")
def small_demo_config():
    """make(directory, name, extra overrides): the demo recipe on batches of 4 prompts x 4 samples, an
    8-problem evaluation every 2 steps, run in directory/name."""

    def make(directory, name, extra=()):
        return load_config("demo_cpu", [f"run.name={name}", f"run.dir={directory / name}", *SMALL, *extra])

    return make
