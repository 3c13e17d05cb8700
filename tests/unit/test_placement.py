"""rl.placement's rules for tensor-parallel engines and how the rollout side turns them into vLLM arguments:
pure functions, no Ray cluster (tests/integration/test_placement_cluster.py reserves them on one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl.config import load_config
from rl.core.compat import vllm_ray_executor_env
from rl.placement import COLOCATED_SHARE, engine_bundles, packed_node_sizes, plan_placement
from rollout.config import RolloutConfig
from rollout.spec import EngineBundles, EngineSpec
from rollout.worker import ModelInfo, engine_kwargs

ROOT = Path(__file__).resolve().parents[2]
MOE = ModelInfo(num_layers=4, num_experts=8, top_k=2, quantization=None)


def _demo(*overrides):
    return load_config("demo_cpu", ["run.name=t", *overrides])


def test_engines_take_whole_groups_of_one_node_whatever_the_bundle_order():
    # Ray may number the bundles of two nodes alternately; each engine still gets bundles of one node.
    nodes = ["a", "b"] * 4
    assert engine_bundles(nodes, 2, 4) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert engine_bundles(nodes, 4, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert engine_bundles(nodes, 1, 3) == [[0], [2], [4]]
    with pytest.raises(ValueError, match=r"sit 7, 1 a node: room for 1 engine\(s\)"):
        engine_bundles(["a"] * 7 + ["b"], 4, 2)


def test_packed_nodes_fill_in_turn():
    assert packed_node_sizes(16, 8) == [8, 8]
    assert packed_node_sizes(12, 8) == [8, 4]
    assert packed_node_sizes(3, 8) == [3]


def test_muse_recipe_colocates_two_tp8_engines_one_a_node():
    cfg = load_config(ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml")
    bundles, place = plan_placement(cfg)
    assert bundles == [{"GPU": 1, "CPU": 2}] * 16
    assert place.rollout_bundles == [list(range(8)), list(range(8, 16))]
    # The engine's actor only drives vLLM's Ray executor; its TP workers hold the GPU shares.
    assert place.rollout_options == {"num_cpus": 1, "num_gpus": 0}
    assert place.rollout_gpus_per_rank == COLOCATED_SHARE == place.trainer_gpus_per_rank
    # What each bundle must hold: trainer rank b (0.5 GPU, 1 CPU), the TP rank there (0.5 GPU, no CPU: vLLM's
    # Ray executor asks num_cpus=0) and, in an engine's first bundle, the engine's actor (1 CPU).
    for b, bundle in enumerate(bundles):
        first = any(e[0] == b for e in place.rollout_bundles)
        gpu = place.trainer_gpus_per_rank + place.rollout_gpus_per_rank + place.rollout_options["num_gpus"]
        cpu = 1 + (place.rollout_options["num_cpus"] if first else 0)
        assert gpu <= bundle["GPU"] and cpu <= bundle["CPU"], b


def test_qwen3_recipe_colocates_four_tp2_engines():
    cfg = load_config(ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml")
    bundles, place = plan_placement(cfg)
    assert len(bundles) == 8 and place.rollout_bundles == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_tp1_colocated_engines_hold_their_share_themselves():
    bundles, place = plan_placement(
        _demo("resources.num_gpus=2", "trainer.num_ranks=2", "rollout.num_workers=2")
    )
    assert place.rollout_options["num_gpus"] == 0.5 and place.rollout_gpus_per_rank == 0.0
    assert place.rollout_bundles == [[0], [1]]


def test_more_trainer_ranks_than_engine_gpus():
    bundles, place = plan_placement(
        _demo(
            "resources.num_gpus=8",
            "trainer.num_ranks=8",
            "rollout.num_workers=1",
            "rollout.tensor_parallel_size=4",
        )
    )
    assert len(bundles) == 8 and place.rollout_bundles == [[0, 1, 2, 3]]


def test_an_engine_never_spans_nodes():
    with pytest.raises(ValueError, match="rollout.num_workers: 2 engine"):
        plan_placement(  # 12 GPUs packed 8 + 4: one TP-6 engine a node at most, and only on the first
            _demo(
                "resources.num_gpus=16",
                "resources.nodes=2",
                "trainer.num_ranks=2",
                "rollout.num_workers=2",
                "rollout.tensor_parallel_size=6",
            )
        )
    with pytest.raises(
        ValueError, match="rollout.tensor_parallel_size: 16 GPUs an engine is more than a node's"
    ):
        plan_placement(
            _demo(
                "resources.num_gpus=16",
                "resources.nodes=2",
                "trainer.num_ranks=16",
                "rollout.tensor_parallel_size=16",
            )
        )


def test_engine_arguments_follow_where_the_ranks_run():
    spec = EngineSpec(model_path="m", rollout=RolloutConfig(tensor_parallel_size=2))
    ray_kw = engine_kwargs(spec, MOE, EngineBundles([4, 5], 0.5))
    assert ray_kw["distributed_executor_backend"] == "ray" and ray_kw["tensor_parallel_size"] == 2
    # Bundles mean GPUs (rl.placement makes them for GPU runs only): not the CPU runner's whole-prefill
    # setting, though the engine's own actor, holding no GPU, may see none (this machine has none at all).
    assert "enable_chunked_prefill" not in ray_kw
    if not torch.cuda.is_available():
        assert engine_kwargs(spec, MOE)["enable_chunked_prefill"] is False
    # split placement: the actor holds both GPUs; vLLM would pick its Ray executor inside a placement group
    assert engine_kwargs(spec, MOE)["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in engine_kwargs(EngineSpec(model_path="m"), MOE)
    with pytest.raises(ValueError, match="3 bundles for tensor_parallel_size 2"):
        engine_kwargs(spec, MOE, EngineBundles([0, 1, 2], 0.5))


def test_engine_bundles_and_the_executor_environment():
    with pytest.raises(ValueError, match="distinct"):
        EngineBundles([1, 1], 0.5)
    with pytest.raises(ValueError, match=r"gpus_per_rank must be in \(0, 1\]"):
        EngineBundles([0, 1], 0.0)
    env = vllm_ray_executor_env([8, 9, 10], 0.5, "10.0.0.1:6379")
    assert env == {
        "VLLM_RAY_BUNDLE_INDICES": "8,9,10",
        "VLLM_RAY_PER_WORKER_GPUS": "0.5",
        "RAY_ADDRESS": "10.0.0.1:6379",
    }


def test_vllm_reads_the_variables_the_engine_sets():
    """The names the executor reads, from the installed vLLM (0.30 here): a rename would leave the TP ranks
    wherever vLLM puts them."""
    envs = pytest.importorskip("vllm.envs")
    assert {"VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"} <= set(envs.environment_variables)
    import inspect

    from vllm.v1.executor import ray_executor, ray_executor_v2

    for module in (ray_executor, ray_executor_v2):
        source = inspect.getsource(module)
        assert "envs.VLLM_RAY_BUNDLE_INDICES" in source and "envs.VLLM_RAY_PER_WORKER_GPUS" in source
