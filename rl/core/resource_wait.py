"""No silent wait for resources: while Ray holds back workers for want of CPU slots or GPUs, say so.

    with report_pending(period_s=30, timeout_s=600):
        pool = RolloutPool(...)        # its constructor waits in resource_wait.get(...)

Code that waits for workers to be placed calls `get(refs)` instead of `ray.get(refs)`. Inside a
`report_pending` block that wait is a loop of `ray.wait(..., timeout=period_s)` in the caller's own thread:
after each period it asks the cluster what is pending (the resource demands that `ray status` shows) and
what it has, and prints that while something is pending; when demands have been pending for `timeout_s` in
a row it raises `ResourceWaitTimeout` with the same message. A slow start with nothing pending (a vLLM
engine loading its weights) prints nothing and never times out. Outside a block, `get` is `ray.get`.
No thread and no signal: Ray's blocking `ray.get` cannot be interrupted from another thread without a
real SIGINT, and a signal is the wrong tool in a process that runs under pytest, make or a Ray job.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

DEFAULT_PERIOD_S = 30.0


class ResourceWaitTimeout(TimeoutError):
    """Workers waited for resources longer than `resources.wait_timeout_s`."""


def _fmt(resources: dict[str, float]) -> str:
    """CPU, GPU and custom resources (not the per-node markers and memory byte counts)."""
    keep = {
        k: v
        for k, v in resources.items()
        if not k.startswith(("node:", "accelerator_type:")) and k not in ("memory", "object_store_memory")
    }
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"


def pending_summary(placement_group_name: str | None = None) -> tuple[list[str], str]:
    """(what of this driver's is pending, what the cluster has). Pending: this job's actors not yet on a
    worker while the cluster has unmet demands, and the named placement group while it is not created.
    Both are empty when nothing of ours waits, whatever other jobs on the cluster wait for.

    Ray's state API (ray.util.state) needs the dashboard, which local instances run without; the GCS
    tables below (what `ray.util.state` reads too) and the autoscaler's status (what `ray status` prints)
    do not."""
    import ray
    from ray._private.state import actors, state
    from ray.autoscaler.v2.sdk import get_cluster_status

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    # PENDING_CREATION lasts until the constructor returns; an actor whose worker has an address is
    # placed and running its constructor (a vLLM engine loading weights), not waiting for resources.
    waiting = Counter(
        a["ActorClassName"]
        for a in actors(job_id=job, actor_state_name="PENDING_CREATION").values()
        if not (a.get("Address") or {}).get("Port")
    )
    groups = (
        [
            f"placement group {pg['name']} ({len(pg['bundles'])} bundles)"
            for pg in state.placement_group_table().values()
            if pg["name"] == placement_group_name and pg["state"] in ("PENDING", "RESCHEDULING")
        ]
        if placement_group_name
        else []
    )
    if not waiting and not groups:
        return [], ""
    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    demands = status.resource_demands
    actor_asks = [
        f"{r.count} x {_fmt(r.bundle)}" for d in demands.ray_task_actor_demand for r in d.bundles_by_count
    ]
    group_asks = [
        f"{r.count} x {_fmt(r.bundle)}" for d in demands.placement_group_demand for r in d.bundles_by_count
    ]
    # An unplaced actor with no unmet demand on the cluster is a worker process being started, not a wait.
    actors_waiting = [f"{n} {name} actor{'s' if n > 1 else ''}" for name, n in sorted(waiting.items())]
    if not actor_asks:
        actors_waiting = []
    pending = actors_waiting + groups
    if not pending:
        return [], ""
    asks = (actor_asks if actors_waiting else []) + (group_asks if groups else [])
    if asks:
        pending.append(f"the cluster's unmet demands {', '.join(asks)}")
    nodes = len(status.active_nodes) + len(status.idle_nodes)
    has = (
        f"the cluster has {_fmt(status.total_resources())} on {nodes} node(s), "
        f"free {_fmt(status.available_resources())}"
    )
    return pending, has


@dataclass(frozen=True)
class _Policy:
    period_s: float
    timeout_s: float
    out: Callable[[str], None]
    what: str
    summary: Callable[[], tuple[list[str], str]]


_POLICY: ContextVar[_Policy | None] = ContextVar("sparkrl_resource_wait", default=None)


@contextmanager
def report_pending(
    period_s: float = DEFAULT_PERIOD_S,
    timeout_s: float = 0.0,
    out: Callable[[str], None] | None = None,
    what: str = "workers",
    summary: Callable[[], tuple[list[str], str]] = pending_summary,
) -> Iterator[None]:
    """Within the block, `get` reports pending resource demands every `period_s`; after `timeout_s`
    (0 = never) of demands pending without a break it raises ResourceWaitTimeout."""
    out = out or (lambda line: print(line, file=sys.stderr, flush=True))
    token = _POLICY.set(_Policy(period_s, timeout_s, out, what, summary))
    try:
        yield
    finally:
        _POLICY.reset(token)


def get(refs: Any) -> Any:
    """`ray.get(refs)` (one ref or a list) that, inside `report_pending`, says what is pending while it
    waits and gives up after the block's timeout."""
    import ray

    policy = _POLICY.get()
    if policy is None:
        return ray.get(refs)
    waiting = list(refs) if isinstance(refs, list | tuple) else [refs]
    since = None  # when the current stretch of pending demands began
    while waiting:
        _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=policy.period_s)
        if not waiting:
            break
        try:
            pending, has = policy.summary()
        except Exception as e:  # noqa: BLE001 - a status query that fails must not break the run
            policy.out(f"resources: could not read the cluster's status ({type(e).__name__}: {e})")
            continue
        if not pending:
            since = None
            continue
        now = time.monotonic()
        since = since if since is not None else now - policy.period_s
        waited = now - since
        if policy.timeout_s and waited >= policy.timeout_s:
            raise ResourceWaitTimeout(
                f"resources.wait_timeout_s: {policy.what} waited {waited:.0f} s for resources and gave up: "
                f"pending {', '.join(pending)}; {has}. Free them, add nodes, lower trainer.num_ranks "
                f"or rollout.num_workers, or raise resources.wait_timeout_s"
            )
        policy.out(f"resources: {policy.what} waiting {waited:.0f} s: pending {', '.join(pending)}; {has}")
    return ray.get(refs)
