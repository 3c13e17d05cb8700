"""Where the workers run: one Ray placement group for trainer ranks and rollout engines.

- CPU: no placement group for the run; every worker takes one CPU slot, the trainer ranks in a group of
  their own (trainer.group.TrainerGroup).
- GPU, `rollout.placement: split`: bundle r = {GPU: 1} for trainer rank r, then one bundle of
  {GPU: tensor_parallel_size} per rollout engine: the engine's actor holds all its GPUs and vLLM's
  multiprocessing executor runs the TP ranks inside it (a bundle sits on one node, so the engine does too).
- GPU, `rollout.placement: colocated`: bundle g = {GPU: 1, CPU: 2} per GPU. Trainer rank g takes half of
  bundle g's GPU (Ray's accounting; the engine sleeps while the trainer works, so each really gets the
  whole GPU in turn). Engine e takes the other half of `tensor_parallel_size` bundles on one node:
  - TP 1: the engine's actor holds 0.5 GPU of its bundle;
  - TP > 1: the actor holds no GPU; vLLM's Ray executor starts one worker a TP rank in the engine's
    bundles (`VLLM_RAY_BUNDLE_INDICES`), each holding `rollout_gpus_per_rank` of its bundle's GPU
    (`VLLM_RAY_PER_WORKER_GPUS`): rollout/worker.py.

An engine never spans nodes. Which node each bundle lands on is only known once Ray reserves the group, so
`create_placement` assigns engines to the bundles Ray put on each node (`engine_bundles`); `plan_placement`
applies the same rule to the layout Ray's PACK strategy gives on an idle cluster (nodes filled in turn),
and `sparkrl plan` reports its verdict, so the plan never passes a layout placement refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl.config import SparkConfig
from rl.core import resource_wait

COLOCATED_SHARE = 0.5  # of a colocated GPU, in Ray's accounting, for the trainer rank and for the engine


@dataclass
class Placement:
    placement_group: Any = None
    trainer_bundle_offset: int = 0
    trainer_gpus_per_rank: float = 1.0
    # Engine i's bundles, one a TP rank (split: its one TP-GPU bundle); the first hosts its actor.
    rollout_bundles: list[list[int]] | None = None
    rollout_options: dict | None = None
    # Colocated TP > 1: each vLLM rank's share of its bundle's GPU (vLLM's Ray executor places the ranks);
    # 0: the engine's actor holds its GPUs itself.
    rollout_gpus_per_rank: float = 0.0
    notes: list[str] = field(default_factory=list)


def packed_node_sizes(bundles: int, gpus_per_node: int) -> list[int]:
    """GPU bundles per node when Ray's PACK strategy reserves `bundles` one-GPU bundles on idle nodes of
    `gpus_per_node`: whole nodes, then the rest on one more."""
    full, rest = divmod(bundles, gpus_per_node)
    return [gpus_per_node] * full + ([rest] if rest else [])


def engine_bundles(bundle_nodes: list[str], tp: int, engines: int) -> list[list[int]]:
    """Bundle indices for each engine: `tp` bundles on one node (bundle_nodes[b] is bundle b's node), in
    bundle order. Raises ValueError when the nodes cannot host `engines` whole engines."""
    by_node: dict[str, list[int]] = {}
    for b, node in enumerate(bundle_nodes):
        by_node.setdefault(node, []).append(b)
    groups = [ids[k : k + tp] for ids in by_node.values() for k in range(0, len(ids) - tp + 1, tp)]
    if len(groups) < engines:
        sizes = ", ".join(str(len(ids)) for ids in by_node.values())
        raise ValueError(
            f"rollout.num_workers: {engines} engine(s) of rollout.tensor_parallel_size={tp} need {tp} GPUs "
            f"each on one node (an engine never spans nodes), but the {len(bundle_nodes)} colocated GPUs sit "
            f"{sizes} a node: room for {len(groups)} engine(s). Use a tensor_parallel_size that divides "
            "resources.gpus_per_node, fewer engines, or more GPUs"
        )
    return groups[:engines]


def plan_placement(cfg: SparkConfig) -> tuple[list[dict], Placement]:
    """(bundles, placement) for the config; bundles is [] on CPU. Pure: no Ray calls. Raises ValueError
    naming the key when the layout cannot work."""
    ro, ranks, res = cfg.rollout, cfg.trainer.num_ranks, cfg.resources
    if res.num_gpus == 0:
        return [], Placement()
    tp, engines = ro.tensor_parallel_size, ro.num_workers
    if tp > res.gpus_per_node:
        raise ValueError(
            f"rollout.tensor_parallel_size: {tp} GPUs an engine is more than a node's "
            f"resources.gpus_per_node={res.gpus_per_node}; an engine never spans nodes"
        )
    # GPU counts against resources.num_gpus are checked with the config (rl.config.validate).
    if ro.placement == "split":
        bundles = [{"GPU": 1, "CPU": 1}] * ranks + [{"GPU": tp, "CPU": 1}] * engines
        return bundles, Placement(
            trainer_bundle_offset=0,
            trainer_gpus_per_rank=1.0,
            rollout_bundles=[[ranks + e] for e in range(engines)],
            rollout_options={"num_cpus": 1, "num_gpus": tp},
        )
    gpus = max(ranks, engines * tp)
    # num_gpus <= nodes x gpus_per_node (rl.config.validate), so the packed nodes are there.
    sizes = packed_node_sizes(gpus, res.gpus_per_node)
    nodes = [f"node {n}" for n, size in enumerate(sizes) for _ in range(size)]
    bundles = [{"GPU": 1, "CPU": 2}] * gpus
    return bundles, Placement(
        trainer_bundle_offset=0,
        trainer_gpus_per_rank=COLOCATED_SHARE,
        rollout_bundles=engine_bundles(nodes, tp, engines),
        # TP > 1: the actor only drives vLLM's Ray executor, whose TP workers hold the GPU shares.
        rollout_options={"num_cpus": 1, "num_gpus": COLOCATED_SHARE if tp == 1 else 0},
        rollout_gpus_per_rank=COLOCATED_SHARE if tp > 1 else 0.0,
    )


def placement_group_name(cfg: SparkConfig) -> str:
    return f"sparkrl-{cfg.run.name}"


def trainer_group_name(cfg: SparkConfig) -> str:
    """The placement group the trainer ranks reserve for themselves where the run has none (CPU)."""
    return f"{placement_group_name(cfg)}-trainer"


def bundle_nodes(pg) -> list[str]:
    """The node id of each bundle of a reserved placement group, in bundle order."""
    from ray.util import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[b] for b in range(len(table))]


def create_placement(cfg: SparkConfig) -> Placement:
    """Reserve the bundles on the cluster (waits until they are free), then give each colocated engine
    bundles Ray put on one node."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles, placement = plan_placement(cfg)
    if not bundles:
        return placement
    pg = placement_group(bundles, strategy="PACK", name=placement_group_name(cfg))
    try:  # waits as long as resources.wait_timeout_s allows, saying what is pending
        resource_wait.get(pg.ready())
    except BaseException:
        remove_placement_group(pg)  # no reservation left queued on the cluster
        raise
    if cfg.rollout.placement == "colocated":
        try:
            placement.rollout_bundles = engine_bundles(
                bundle_nodes(pg), cfg.rollout.tensor_parallel_size, cfg.rollout.num_workers
            )
        except ValueError as e:  # the cluster was not idle: Ray split the bundles differently
            remove_placement_group(pg)
            raise RuntimeError(f"placement: as Ray reserved the bundles, {e}") from None
    placement.placement_group = pg
    return placement
