"""Data-parallel rollout: one `RolloutWorker` Ray actor per vLLM engine, with recovery from a dead actor.

A batch is split by prompt group (all samples of a group on one worker, contiguous shares), each worker
generates its share, and the results come back in request order. When an actor dies (its process or
node is gone), the pool recreates it, replays the current weights (adapter or merged) and retries that
share once; a second failure fails the step with the worker's own error. An exception raised *inside*
a live worker (a bad request, broken routing) is not retried: it is a bug, not bad luck.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from rl.core import resource_wait
from rollout.spec import EngineBundles, EngineSpec, PromptRequest, SamplingSpec
from rollout.worker import RolloutWorker

log = logging.getLogger(__name__)
_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


def split_by_group(requests: list[PromptRequest], num_workers: int) -> list[list[int]]:
    """Request indices per worker: whole groups, contiguous, balanced by request count."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.group, []).append(i)
    shares: list[list[int]] = [[] for _ in range(num_workers)]
    per_worker = -(-len(requests) // num_workers) if requests else 0
    w = 0
    for indices in groups.values():
        if shares[w] and len(shares[w]) + len(indices) > per_worker and w < num_workers - 1:
            w += 1
        shares[w].extend(indices)
    return shares


class RolloutPool:
    """`num_workers` RolloutWorker actors; the same methods as RolloutWorker, over the whole pool.

    `actor_options` go to `ray.remote(...).options()`; by default one CPU, and where the cluster has
    GPUs, `tensor_parallel_size` GPUs a worker (split placement) or half of that (colocated placement,
    sleep mode on: the trainer holds the other half). `placement_group` / `bundle_indices` pin worker i
    to its bundles `bundle_indices[i]` (default [i]): one bundle, the worker's actor holding its GPUs; or
    one bundle a TP rank (rl.placement, colocated TP > 1), the actor in the first, and vLLM's Ray executor
    placing the ranks, each holding `gpus_per_rank` of its bundle's GPU.
    """

    def __init__(
        self,
        spec: EngineSpec,
        num_workers: int,
        stage: str,
        placement_group=None,
        bundle_indices: list[list[int]] | None = None,
        actor_options: dict | None = None,
        worker_cls: type = RolloutWorker,
        gpus_per_rank: float = 0.0,
        wait: bool = True,
    ):
        if num_workers < 1:
            raise ValueError(f"RolloutPool: num_workers must be >= 1, got {num_workers}")
        self.spec, self.num_workers, self.stage = spec, num_workers, str(stage)
        self._placement_group = placement_group
        self._bundles = bundle_indices or [[i] for i in range(num_workers)]
        if len(self._bundles) != num_workers:
            raise ValueError(f"RolloutPool: {len(self._bundles)} bundle lists for {num_workers} workers")
        self._gpus_per_rank = gpus_per_rank
        self._options = actor_options if actor_options is not None else self._default_options(spec)
        self._remote_cls = ray.remote(worker_cls)
        # What a recreated worker must load to match the others: ("adapter"|"merged", object ref, ...).
        self._replay: tuple | None = None
        self.restarts = 0
        self.workers = [self._create(i) for i in range(num_workers)]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until every engine has started (`wait=False` left the caller to call this, after starting other
        workers beside them). Surfaces engine start errors; inside rl.core.resource_wait.report_pending, says
        what is pending."""
        resource_wait.get([w.ping.remote() for w in self.workers])

    @staticmethod
    def _default_options(spec: EngineSpec) -> dict:
        options: dict[str, Any] = {"num_cpus": 1}
        if ray.cluster_resources().get("GPU", 0) > 0:
            share = 0.5 if spec.enable_sleep_mode else 1.0
            options["num_gpus"] = spec.rollout.tensor_parallel_size * share
        return options

    def engine_bundles(self, i: int) -> EngineBundles | None:
        """Worker i's TP-rank bundles for vLLM's Ray executor; None when its actor holds its GPUs."""
        bundles = self._bundles[i]
        if self._placement_group is None or len(bundles) == 1:
            return None
        return EngineBundles(list(bundles), self._gpus_per_rank)

    def _create(self, i: int):
        options = dict(self._options)
        bundles = self.engine_bundles(i)
        if self._placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group,
                placement_group_bundle_index=self._bundles[i][0],
                # vLLM's Ray executor starts the TP workers as this actor's children, in this group.
                placement_group_capture_child_tasks=bundles is not None,
            )
        return self._remote_cls.options(**options).remote(self.spec, self.stage, bundles)

    def _recreate(self, i: int, cause: BaseException) -> None:
        log.warning("rollout worker %d died (%s); recreating it", i, cause)
        try:
            ray.kill(self.workers[i], no_restart=True)
        except Exception:  # already gone
            pass
        self.restarts += 1
        self.workers[i] = self._create(i)
        if self._replay is not None:
            kind, ref, *rest = self._replay
            if kind == "adapter":
                peft_config, version = rest
                ray.get(self.workers[i].load_adapter.remote(ref, peft_config, version))
            else:
                (version,) = rest
                ray.get(self.workers[i].load_merged_weights.remote(ref, version))
        else:
            ray.get(self.workers[i].ping.remote())

    def _call(self, method: str, per_worker_args: list[tuple | None]) -> list[Any]:
        """Call `method` on every worker with its args (None: skip it); recover each dead worker once."""
        refs = {
            i: getattr(w, method).remote(*args)
            for i, (w, args) in enumerate(zip(self.workers, per_worker_args))
            if args is not None
        }
        results: dict[int, Any] = {}
        for i, ref in refs.items():
            try:
                results[i] = ray.get(ref)
            except _DEAD as first:
                self._recreate(i, first)
                try:
                    results[i] = ray.get(getattr(self.workers[i], method).remote(*per_worker_args[i]))
                except _DEAD as second:
                    raise RuntimeError(
                        f"rollout worker {i} died again after being recreated ({method}): {second}"
                    ) from second
        return [results.get(i) for i in range(self.num_workers)]

    # ---- the RolloutWorker methods, pool-wide --------------------------------------------------
    def generate(self, requests: list[PromptRequest], sampling: SamplingSpec) -> list:
        """`sampling.n` samples per request, in request order (then sample index)."""
        shares = split_by_group(requests, self.num_workers)
        # Each worker gets its share's places in the whole batch: the seeds follow them, so no two
        # requests of a batch share a seed (each worker counting from 0 gave its first request the same
        # noise as every other worker's first request).
        args = [([requests[i] for i in share], sampling, share) if share else None for share in shares]
        by_request: list[list | None] = [None] * len(requests)
        for share, samples in zip(shares, self._call("generate", args)):
            for k, i in enumerate(share):
                by_request[i] = samples[k * sampling.n : (k + 1) * sampling.n]
        return [s for samples in by_request for s in samples]

    def prompt_logprobs(self, token_ids_list: list[list[int]], use_adapter: bool = True) -> list:
        n = len(token_ids_list)
        bounds = [n * w // self.num_workers for w in range(self.num_workers + 1)]
        args = [(token_ids_list[a:b], use_adapter) if b > a else None for a, b in zip(bounds, bounds[1:])]
        return [lp for part in self._call("prompt_logprobs", args) if part for lp in part]

    def load_adapter(self, adapter, peft_config: dict | None, version: int) -> dict:
        """Load the adapter on every worker; `perf/sync_bytes` sums the workers, `perf/sync_s` is wall time.
        `adapter`: the tensors, a PEFT directory, or a Ray reference to either (TrainerGroup.export_adapter_ref:
        the workers read the trainer's copy)."""
        start = time.perf_counter()
        ref = adapter if isinstance(adapter, ray.ObjectRef) else ray.put(adapter)
        self._replay = ("adapter", ref, peft_config, version)
        metrics = self._call("load_adapter", [(ref, peft_config, version)] * self.num_workers)
        return self._sync_metrics(metrics, start)

    def load_merged_weights(self, named_tensors, version: int) -> dict:
        """named_tensors: the weights, or a Ray reference to them (TrainerGroup.export_merged_ref)."""
        start = time.perf_counter()
        ref = named_tensors if isinstance(named_tensors, ray.ObjectRef) else ray.put(named_tensors)
        self._replay = ("merged", ref, version)
        metrics = self._call("load_merged_weights", [(ref, version)] * self.num_workers)
        return self._sync_metrics(metrics, start)

    @staticmethod
    def _sync_metrics(per_worker: list[dict], start: float) -> dict:
        out = {
            "perf/sync_bytes": sum(m["perf/sync_bytes"] for m in per_worker),
            "perf/sync_s": time.perf_counter() - start,
        }
        # The slowest worker's split of its load (ours: conversion + staged write; vLLM's): where a slow
        # sync spends its time.
        for key in ("perf/sync_stage_s", "perf/sync_engine_s"):
            if all(key in m for m in per_worker):
                out[key] = max(m[key] for m in per_worker)
        return out

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", [(level,)] * self.num_workers)

    def wake_up(self) -> None:
        self._call("wake_up", [()] * self.num_workers)

    def ping(self) -> list[dict]:
        return self._call("ping", [()] * self.num_workers)

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except Exception as e:  # a dead worker has nothing left to shut down
                log.warning("rollout worker shutdown: %s", e)
            ray.kill(w, no_restart=True)
        self.workers = []
