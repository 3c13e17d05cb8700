"""Where the workers run: one Ray placement group for trainer ranks and rollout engines.

- CPU: no placement group; every worker takes one CPU slot.
- GPU, `rollout.placement: split`: bundle r = {GPU: 1} for trainer rank r, then one bundle of
  {GPU: tensor_parallel_size} per rollout engine (vLLM's own executor runs the TP workers inside it).
- GPU, `rollout.placement: colocated`: bundle g = {GPU: 1} per GPU; trainer rank g and rollout engine g
  share it at 0.5 GPU each (Ray's accounting; the engine sleeps while the trainer works, so each really
  gets the whole GPU in turn). Colocated engines are TP 1 for now: a TP engine would need its ranks spread
  over bundles that trainer ranks also hold, which needs vLLM's Ray executor inside the placement group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl.config import SparkConfig


@dataclass
class Placement:
    placement_group: Any = None
    trainer_bundle_offset: int = 0
    trainer_gpus_per_rank: float = 1.0
    rollout_bundles: list[int] | None = None
    rollout_options: dict | None = None
    notes: list[str] = field(default_factory=list)


def plan_placement(cfg: SparkConfig) -> tuple[list[dict], Placement]:
    """(bundles, placement) for the config; bundles is [] on CPU. Pure: no Ray calls."""
    ro, ranks = cfg.rollout, cfg.trainer.num_ranks
    if cfg.resources.num_gpus == 0:
        return [], Placement()
    tp, engines = ro.tensor_parallel_size, ro.num_workers
    # GPU counts against resources.num_gpus are checked with the config (rl.config.validate).
    if ro.placement == "split":
        bundles = [{"GPU": 1, "CPU": 1}] * ranks + [{"GPU": tp, "CPU": 1}] * engines
        return bundles, Placement(
            trainer_bundle_offset=0,
            trainer_gpus_per_rank=1.0,
            rollout_bundles=list(range(ranks, ranks + engines)),
            rollout_options={"num_cpus": 1, "num_gpus": tp},
        )
    if tp != 1:
        raise ValueError(
            f"rollout.tensor_parallel_size: colocated placement runs TP-1 engines for now, got {tp}; "
            "use rollout.placement=split for tensor-parallel engines"
        )
    gpus = max(ranks, engines)
    bundles = [{"GPU": 1, "CPU": 2}] * gpus
    return bundles, Placement(
        trainer_bundle_offset=0,
        trainer_gpus_per_rank=0.5,
        rollout_bundles=list(range(engines)),
        rollout_options={"num_cpus": 1, "num_gpus": 0.5},
    )


def placement_group_name(cfg: SparkConfig) -> str:
    return f"sparkrl-{cfg.run.name}"


def create_placement(cfg: SparkConfig) -> Placement:
    """Reserve the bundles on the cluster (waits until they are free)."""
    import ray
    from ray.util.placement_group import placement_group

    bundles, placement = plan_placement(cfg)
    if not bundles:
        return placement
    pg = placement_group(bundles, strategy="PACK", name=placement_group_name(cfg))
    ready, _ = ray.wait([pg.ready()], timeout=600)
    if not ready:
        raise RuntimeError(
            f"placement: the cluster could not give {len(bundles)} bundles {bundles[0]} ... within "
            f"10 minutes (ray status shows what is free)"
        )
    placement.placement_group = pg
    return placement
