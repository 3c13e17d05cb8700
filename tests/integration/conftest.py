"""Shared by the GRPO run tests (test_train_e2e.py, test_train_runs.py): a small demo config, and a local Ray
instance a module."""

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


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)  # never another cluster on the machine
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def small_demo_config():
    """make(directory, name, extra overrides): the demo recipe on batches of 4 prompts x 4 samples, an
    8-problem evaluation every 2 steps, run in directory/name."""

    def make(directory, name, extra=()):
        return load_config("demo_cpu", [f"run.name={name}", f"run.dir={directory / name}", *SMALL, *extra])

    return make
