"""The reference recipes' placement groups reserved on a multi-node Ray cluster, and the rollout pool's
engines scheduled into them.

The cluster is real Ray (`ray.cluster_utils.Cluster`, several raylets on this machine) whose nodes declare
8 GPUs each: Ray does not check, and this machine has none. vLLM's Ray executor cannot start GPU workers
here, so `EngineStandIn` takes the RolloutWorker's place in the pool: it is scheduled by RolloutPool
exactly as a RolloutWorker is, computes the environment the real worker hands vLLM (rollout.worker's
`engine_env`), and starts one actor a TP rank the way vLLM's Ray executor does from that environment
(vllm/v1/executor/ray_executor*.py: num_cpus=0, num_gpus=VLLM_RAY_PER_WORKER_GPUS, in bundle
VLLM_RAY_BUNDLE_INDICES[rank] of the actor's placement group). `TrainerStandIn` takes a trainer rank's
share of its bundle as TrainerGroup asks for it. Ports are Ray's random ones, the temp dir the test's own.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util import placement_group_table  # noqa: E402
from ray.util.placement_group import get_current_placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from rl.config import load_config  # noqa: E402
from rl.placement import create_placement  # noqa: E402
from rollout.config import RolloutConfig  # noqa: E402
from rollout.pool import RolloutPool  # noqa: E402
from rollout.spec import EngineSpec  # noqa: E402
from rollout.worker import engine_env  # noqa: E402
from trainer.rendezvous import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    """A cluster of two nodes of 8 GPUs and 16 CPUs (two a bundle), connected, for the module: the Muse
    recipe spans both; the Qwen3 recipe's group, reserved after Muse's is removed, packs into one."""
    # Ray writes the cluster's address under its temp dir for `ray.init("auto")`: keep it to this module.
    tmp = tempfile.mkdtemp(prefix="sprk-", dir="/tmp")  # short: Ray's socket paths live under it
    env = pytest.MonkeyPatch()
    env.setenv("RAY_TMPDIR", tmp)
    # The stand-in actors below are this module's classes, sent by value: the nodes' workers need not
    # import this module (nor, but for the engine stand-ins' rollout.worker, torch: 20 actors start here).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.makedirs(os.path.join(tmp, "ray"))
    node = {
        "num_cpus": 16,
        "num_gpus": 8,
        "include_dashboard": False,
        "dashboard_agent_listen_port": None,  # Ray's default is a fixed port; None: a random one
        "temp_dir": os.path.join(tmp, "ray"),
    }
    c = Cluster(initialize_head=True, head_node_args={**node, "gcs_server_port": free_port()})
    try:
        c.add_node(**node)
        c.wait_for_nodes()
        c.connect()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        env.undo()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        shutil.rmtree(tmp, ignore_errors=True)


class EngineStandIn:
    """RolloutWorker's constructor and ping; reports where it runs and starts its TP ranks as vLLM would."""

    def __init__(self, spec, stage, bundles=None):
        self.bundles = bundles
        self.env = engine_env(spec, bundles)
        self.ranks = []

    def ping(self):
        return {"pid": os.getpid()}

    def where(self) -> dict:
        pg = get_current_placement_group()
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "pg": None if pg is None else pg.id.hex(),
            "env": self.env,
            "bundles": None if self.bundles is None else list(self.bundles.bundle_indices),
        }

    def start_ranks(self) -> list[str]:
        """One actor a TP rank, placed from the environment as vLLM's Ray executor places its workers."""
        pg = get_current_placement_group()
        share = float(self.env["VLLM_RAY_PER_WORKER_GPUS"])
        for b in map(int, self.env["VLLM_RAY_BUNDLE_INDICES"].split(",")):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=b, placement_group_capture_child_tasks=True
            )
            self.ranks.append(
                ray.remote(RankStandIn)
                .options(num_cpus=0, num_gpus=share, scheduling_strategy=strategy)
                .remote()
            )
        return ray.get([r.node.remote() for r in self.ranks])


class RankStandIn:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class TrainerStandIn:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _bundle_nodes(pg) -> dict[int, str]:
    return placement_group_table(pg)["bundles_to_node_id"]


def _pool(cfg, place):
    return RolloutPool(
        EngineSpec(
            model_path="unused", rollout=RolloutConfig(tensor_parallel_size=cfg.rollout.tensor_parallel_size)
        ),
        cfg.rollout.num_workers,
        "unused",
        placement_group=place.placement_group,
        bundle_indices=place.rollout_bundles,
        actor_options=place.rollout_options,
        worker_cls=EngineStandIn,
        gpus_per_rank=place.rollout_gpus_per_rank,
    )


def test_muse_reserves_16_gpus_on_two_nodes_one_engine_a_node(cluster):
    c = cluster
    # with expert parallelism over each node's 8 GPUs (trainer.expert_parallel_size: the config refuses a
    # group that would span nodes)
    overrides = ["run.name=place-muse", "trainer.expert_parallel_size=8"]
    cfg = load_config(ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml", overrides)
    place = create_placement(cfg)
    try:
        pg = place.placement_group
        assert placement_group_table(pg)["state"] == "CREATED"
        nodes = _bundle_nodes(pg)
        assert len(nodes) == 16 and sorted(list(nodes.values()).count(n) for n in set(nodes.values())) == [
            8,
            8,
        ]
        # trainer rank r takes bundle offset + r: each EP group of 8 consecutive ranks sits on one node
        ep, ranks = cfg.trainer.expert_parallel_size, cfg.trainer.num_ranks
        groups = [
            {nodes[place.trainer_bundle_offset + r] for r in range(g, g + ep)} for g in range(0, ranks, ep)
        ]
        assert [len(g) for g in groups] == [1, 1] and groups[0] != groups[1]
        engine_nodes = [{nodes[b] for b in engine} for engine in place.rollout_bundles]
        assert [len(e) for e in place.rollout_bundles] == [8, 8]
        assert all(len(n) == 1 for n in engine_nodes)  # each engine on one node
        assert engine_nodes[0] != engine_nodes[1]  # and one engine a node
        pool = _pool(cfg, place)
        for i, where in enumerate(ray.get([w.where.remote() for w in pool.workers])):
            assert where["pg"] == pg.id.hex() and where["bundles"] == place.rollout_bundles[i]
            assert {where["node"]} == engine_nodes[i]  # the engine's actor sits with its ranks
            assert where["env"]["VLLM_RAY_BUNDLE_INDICES"] == ",".join(map(str, place.rollout_bundles[i]))
            assert where["env"]["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
            assert where["env"]["RAY_ADDRESS"] == c.address
        for w in pool.workers:
            ray.kill(w)
    finally:
        remove_placement_group(place.placement_group)


def test_qwen3_fills_one_node_with_trainer_ranks_and_tp_ranks(cluster):
    cfg = load_config(ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml", ["run.name=place-qwen"])
    place = create_placement(cfg)
    pg = place.placement_group
    try:
        nodes = _bundle_nodes(pg)
        assert len(nodes) == 8 and len(set(nodes.values())) == 1
        assert place.rollout_bundles == [[0, 1], [2, 3], [4, 5], [6, 7]]
        pool = _pool(cfg, place)
        trainers = [
            ray.remote(TrainerStandIn)
            .options(
                num_gpus=place.trainer_gpus_per_rank,
                num_cpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=place.trainer_bundle_offset + r
                ),
            )
            .remote()
            for r in range(cfg.trainer.num_ranks)
        ]
        # Every trainer rank and every TP rank gets its half GPU beside the other (the group has 8 GPUs for
        # 16 half shares): a share too large would leave an actor unscheduled and these gets timing out.
        trainer_nodes = ray.get([t.node.remote() for t in trainers], timeout=600)
        rank_nodes = ray.get([w.start_ranks.remote() for w in pool.workers], timeout=600)
        assert set(trainer_nodes) == set(nodes.values())
        assert [len(n) for n in rank_nodes] == [2, 2, 2, 2]
        assert all(set(n) == set(nodes.values()) for n in rank_nodes)
    finally:
        remove_placement_group(pg)
