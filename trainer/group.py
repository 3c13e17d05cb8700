"""The trainer ranks as Ray actors, joined in one torch.distributed group; a batch is split across them by
tokens and the results come back in the batch's order."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from rl.core import resource_wait
from rl.core.batch import Sample
from rl.core.worker_logs import crash_report
from trainer.batching import in_batch_order, split_by_tokens
from trainer.minibatch import mini_batch_plan, steps_per_batch
from trainer.rendezvous import rank0_endpoint
from trainer.spec import TrainerSpec
from trainer.worker import TrainerWorker

# How long a failed call waits for the other ranks' calls, to tell a dead rank from its peers' errors.
LOST_RANK_GRACE_S = 60.0


def for_ranks(directory: str | Path) -> str:
    """A directory as the ranks must be told it: absolute, from the driver's working directory. A rank on
    another node runs in its raylet's working directory, where a relative `runs/<name>` names another place
    (on a shared filesystem, the driver's absolute path is the one all nodes see)."""
    return str(Path(directory).absolute())


class TrainerRankLost(RuntimeError):
    """A trainer rank's actor is gone (its process, or the node it ran on): the group cannot go on, as
    every step is collective over all ranks. Names the rank and its node; where the rank's output file is
    readable from here (same machine or a shared disk), names it, and a rank that crashed (a native abort, a
    segfault) adds what it wrote there: the reason and every thread's stack."""

    def __init__(
        self, rank: int, node_ip: str, node_id: str, cause: BaseException, output: str | None = None
    ):
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        message = f"trainer rank {rank} on node {node_ip} (node id {node_id}) was lost: {first}"
        if output and Path(output).is_file():
            report = crash_report(Path(output))
            message += f" (its output: {output}" + (f"; it crashed:\n{report}\n)" if report else ")")
        super().__init__(message)
        self.rank, self.node_ip, self.node_id = rank, node_ip, node_id


class TrainerGroup:
    """num_ranks TrainerWorker actors (CPU: gloo, num_cpus=1 each; GPU: NCCL, num_gpus=1 each).

    placement_group: bundles for the ranks (bundle bundle_offset + r hosts rank r), e.g. to share GPUs
    with rollout; num_gpus_per_rank is then the rank's share of its bundle's GPU. None: the group reserves
    one of its own, a bundle a rank (named `placement_group_name`, so that a wait for it is reported), and
    removes it at shutdown. Ranks asked for one by one, with no reservation, can be leased together to one
    node's last free slot, where Ray (2.60) left the second waiting for good while another node was idle.
    master_addr, master_port: where rank 0 listens for the rendezvous. By default the address Ray reports
    for the node rank 0 runs on, and a port free there (`rank0_endpoint`): the driver's own node may hold
    no rank at all, and on a cluster of several machines its address is not rank 0's.
    """

    def __init__(
        self,
        spec: TrainerSpec,
        num_ranks: int,
        *,
        use_gpu: bool = False,
        placement_group=None,
        bundle_offset: int = 0,
        num_gpus_per_rank: float = 1.0,
        master_addr: str | None = None,
        master_port: int | None = None,
        wait: bool = True,
        placement_group_name: str = "",
    ):
        if num_ranks < 1:
            raise ValueError(f"TrainerGroup: num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self.spec = spec
        self.batches = 0  # train_step calls so far (restored by load_checkpoint): seeds the mini-batch order
        self.nodes: list[tuple[str, str]] = []  # rank -> (node id, node address), once the ranks are up
        self.outputs: list[str | None] = []  # rank -> the file its stderr goes to, once the ranks are up
        self.broken = False  # a rank is lost or stuck: ranks may wait in a collective, so shutdown only kills
        # colocated with rollout engines: a fraction of the rank's GPU (the engine holds the rest)
        resources = {"num_gpus": num_gpus_per_rank, "num_cpus": 1} if use_gpu else {"num_cpus": 1}
        self.own_placement_group = None
        if placement_group is None:
            from ray.util.placement_group import placement_group as reserve

            bundle = {"CPU": 1, **({"GPU": num_gpus_per_rank} if use_gpu else {})}
            placement_group = reserve([bundle] * num_ranks, strategy="PACK", name=placement_group_name)
            self.own_placement_group, bundle_offset = placement_group, 0
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = [
            {
                **resources,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_offset + r
                ),
            }
            for r in range(num_ranks)
        ]
        self.workers = []
        try:
            if master_addr is None or master_port is None:
                addr, port = rank0_endpoint(options[0])  # in rank 0's bundle, once Ray has reserved it
                master_addr, master_port = master_addr or addr, master_port or port
            self.master_addr, self.master_port = master_addr, master_port
            actor = ray.remote(TrainerWorker)
            self.workers = [
                actor.options(**opts).remote(r, num_ranks, self.master_addr, self.master_port, spec)
                for r, opts in enumerate(options)
            ]
            if wait:
                self.wait_ready()
        except BaseException:
            self.broken = True  # ranks may be waiting in the rendezvous for one that failed
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Until every rank's constructor has returned (`wait=False` left the caller to call this). The
        constructors join the process group together; a failure in one surfaces here."""
        self.nodes = resource_wait.get([w.node.remote() for w in self.workers])
        self.outputs = ray.get([w.output.remote() for w in self.workers])

    def _get(self, refs: list[ray.ObjectRef], ranks: list[int] | None = None) -> list:
        """`ray.get(refs)`, one result a rank (refs[i] of rank ranks[i]; by default rank i), that fails as
        soon as one rank fails: the others may be waiting for it in a collective, where they would wait
        until gloo's or NCCL's timeout. When a rank's actor died, that is the error (TrainerRankLost);
        otherwise the first rank's error as it is."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception:
                self._raise_if_a_rank_died([ready[0], *pending], dict(zip(refs, ranks)))
                raise
        return ray.get(refs)

    def _raise_if_a_rank_died(self, failed: list[ray.ObjectRef], rank_of: dict) -> None:
        """TrainerRankLost if one of `failed` (the failed call and those still running) is a dead rank's.
        A live rank's error often comes first and is only its collective's with the dead one (gloo:
        "Connection reset by peer"): Ray declares a lost node dead after missed health checks. So this
        waits up to LOST_RANK_GRACE_S for the other calls to end. Calls still running after that leave the
        group broken (`shutdown` kills it); when every call ended (all ranks raised one error together, as
        TrainerWorker._agree does), the group can go on."""
        deadline = time.monotonic() + LOST_RANK_GRACE_S
        while failed:
            ready, failed = ray.wait(failed, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.broken = True
                return
            try:
                ray.get(ready[0])
            except RayActorError as e:
                self.broken = True
                rank = rank_of[ready[0]]
                node_id, ip = self.nodes[rank] if rank < len(self.nodes) else ("?", "?")
                output = self.outputs[rank] if rank < len(self.outputs) else None
                raise TrainerRankLost(rank, ip, node_id, e, output) from e
            except Exception:  # noqa: BLE001 - a live rank's own error: the caller raises the first one
                pass

    def _split(self, samples: list[Sample]) -> list[list[int]]:
        return split_by_tokens([s.num_tokens for s in samples], self.num_ranks)

    def log_probs(
        self, samples: list[Sample], version: int | None = None, live: bool = True
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """The samples' response log-probs at adapter `version` (a kept older one; None: the current); live:
        with r3.measure_live_kl, also the live-routing score (TrainerWorker.log_probs)."""
        parts = self._split(samples)
        results = self._get(
            [
                w.log_probs.remote([samples[i] for i in p], p, version, live)
                for w, p in zip(self.workers, parts)
            ]
        )
        return in_batch_order(len(samples), parts, [values for values, _ in results]), results[0][1]

    def can_score_in_update(self, samples: list[Sample]) -> bool:
        """Whether `train_step(..., return_logprobs=True)` gives this batch's log-probs at the current
        adapter, as `log_probs` would: one optimizer step over the batch, old log-probs not needed before it
        (no TIS/MIS), a deterministic forward (no LoRA dropout), and no live-routing score (that is
        `log_probs`' own extra forward)."""
        spec = self.spec
        groups = len({s.group for s in samples})
        one_step = steps_per_batch(groups, spec.trainer.mini_batch_size, spec.trainer.ppo_epochs) == 1
        live = spec.r3 and spec.r3_live_kl
        return one_step and not spec.algo.corrects_rollout and not spec.lora.dropout and not live

    def train_step(
        self,
        samples: list[Sample],
        advantages: list[float],
        old_logprobs: list[np.ndarray] | None = None,
        return_logprobs: bool = False,
    ) -> dict[str, float] | tuple[dict[str, float], list[np.ndarray]]:
        """One batch: `trainer.ppo_epochs` passes of one optimizer step per mini-batch (trainer.minibatch).
        Each mini-batch is split over the ranks by tokens; a rank gets every sample it trains on in any
        step once, with the steps as lists of its local indices. return_logprobs (one on-policy step):
        also the update forward's log-probs, in the batch's order (TrainerWorker.train_step)."""
        if len(advantages) != len(samples):
            raise ValueError(f"train_step: {len(advantages)} advantages for {len(samples)} samples")
        plan = mini_batch_plan(
            [s.group for s in samples],
            self.spec.trainer.mini_batch_size,
            self.spec.trainer.ppo_epochs,
            self.spec.seed,
            self.batches,
        )
        per_rank: list[list[list[int]]] = [[] for _ in self.workers]  # rank -> step -> global indices
        for step in plan:
            for r, part in enumerate(self._split([samples[i] for i in step])):
                per_rank[r].append([step[j] for j in part])
        refs, helds = [], []
        for w, steps in zip(self.workers, per_rank):
            held = sorted({i for step in steps for i in step})
            local = {g: k for k, g in enumerate(held)}
            refs.append(
                w.train_step.remote(
                    [samples[i] for i in held],
                    [advantages[i] for i in held],
                    None if old_logprobs is None else [old_logprobs[i] for i in held],
                    held,
                    [[local[i] for i in step] for step in steps],
                    return_logprobs,
                )
            )
            helds.append(held)
        results = self._get(refs)
        self.batches += 1
        if not return_logprobs:
            return results[0]
        return results[0][0], in_batch_order(len(samples), helds, [values for _, values in results])

    def _on_all(self, method: str, *args):
        return self._get([getattr(w, method).remote(*args) for w in self.workers])

    def export_adapter(self, dtype: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        return self._on_all("export_adapter", dtype)[0]

    def export_adapter_ref(
        self, dtype: str | None = None, version: int | None = None
    ) -> tuple[ray.ObjectRef, dict]:
        """As export_adapter, but the tensors stay in Ray's object store (a reference to rank 0's dict): the
        rollout workers read them from there, so the driver neither receives nor re-sends them (twice the
        adapter's bytes through pickling per sync otherwise). version: a kept older one (None: current)."""
        pairs = [w.export_adapter_pair.options(num_returns=2).remote(dtype, version) for w in self.workers]
        configs = self._get([config for _, config in pairs])  # every rank done: the gathers are collective
        return pairs[0][0], configs[0]

    def export_merged(self) -> dict[str, torch.Tensor]:
        return self._on_all("export_merged")[0]

    def export_merged_ref(self, version: int | None = None) -> ray.ObjectRef:
        """As export_merged, but the weights stay in the object store of rank 0's node (a reference to its
        dict): the rollout workers read them from there, not through the driver. version: a kept older
        one (None: current)."""
        refs = [w.export_merged.remote(version) for w in self.workers]
        # The other ranks' None: every rank is done (the gathers are collective). An error of rank 0's
        # surfaces where the rollout workers resolve the reference.
        self._get(refs[1:], ranks=list(range(1, len(refs))))
        return refs[0]

    def release_cached_memory(self) -> list[int]:
        """Every rank's cached free GPU blocks returned to the device (TrainerWorker.release_cached_memory);
        the bytes each rank still reserves."""
        return self._on_all("release_cached_memory")

    def gradients(self) -> dict[str, torch.Tensor]:
        return self._on_all("gradients")[0]

    def load_adapter(self, directory: str | Path) -> None:
        self._on_all("load_adapter", for_ranks(directory))

    def save_checkpoint(self, directory: str | Path) -> None:
        self._on_all("save_checkpoint", for_ranks(directory))

    def load_checkpoint(self, directory: str | Path) -> int:
        self.batches = self._on_all("load_checkpoint", for_ranks(directory))[0]
        return self.batches

    def shutdown(self) -> None:
        """Idempotent. After a failed call only kills the ranks: a live one may be waiting in a collective
        for a dead one."""
        try:
            if self.workers and not self.broken:
                self._on_all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            self.workers = []
            if self.own_placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.own_placement_group)  # its slots free for the next group
                self.own_placement_group = None
