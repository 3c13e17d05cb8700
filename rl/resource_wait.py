"""No silent wait for resources: while Ray holds back workers for want of CPU slots or GPUs, say so.

    with report_pending(period_s=30, timeout_s=600):
        pool = RolloutPool(...)        # blocks in ray.get until its actors are placed

A watcher thread asks the cluster every `period_s` what is pending (the resource demands that `ray status`
shows) and what it has. While something is pending it prints that; when demands have been pending for
`timeout_s` in a row it interrupts the waiting main thread, and the block raises `ResourceWaitTimeout` with
the same message. A slow start with nothing pending (a vLLM engine loading its weights) prints nothing and
never times out.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
    """(what of this driver's is pending, what the cluster has). Pending: this job's actors still waiting
    to be placed, and the named placement group while it is not created. Both are empty when nothing of
    ours waits, whatever other jobs on the cluster wait for.

    Ray's state API (ray.util.state) needs the dashboard, which local instances run without; the GCS
    tables below (what `ray.util.state` reads too) and the autoscaler's status (what `ray status` prints)
    do not."""
    import ray
    from ray._private.state import actors, state
    from ray.autoscaler.v2.sdk import get_cluster_status

    job = ray.get_runtime_context().job_id
    waiting = Counter(
        a["ActorClassName"] for a in actors(job_id=job, actor_state_name="PENDING_CREATION").values()
    )
    pending = [f"{n} {name} actor{'s' if n > 1 else ''}" for name, n in sorted(waiting.items())]
    if placement_group_name:
        pending += [
            f"placement group {pg['name']} ({len(pg['bundles'])} bundles)"
            for pg in state.placement_group_table().values()
            if pg["name"] == placement_group_name and pg["state"] in ("PENDING", "RESCHEDULING")
        ]
    if not pending:
        return [], ""
    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    demands = status.resource_demands
    asks = [
        f"{r.count} x {_fmt(r.bundle)}"
        for d in demands.ray_task_actor_demand + demands.placement_group_demand
        for r in d.bundles_by_count
    ]
    if asks:
        pending.append(f"the cluster's unmet demands {', '.join(asks)}")
    nodes = len(status.active_nodes) + len(status.idle_nodes)
    has = (
        f"the cluster has {_fmt(status.total_resources())} on {nodes} node(s), "
        f"free {_fmt(status.available_resources())}"
    )
    return pending, has


@contextmanager
def report_pending(
    period_s: float = DEFAULT_PERIOD_S,
    timeout_s: float = 0.0,
    out: Callable[[str], None] | None = None,
    what: str = "workers",
    summary: Callable[[], tuple[list[str], str]] = pending_summary,
) -> Iterator[None]:
    """Report pending resource demands every `period_s` while the block runs; after `timeout_s` (0 = never)
    of demands pending without a break, interrupt the block with ResourceWaitTimeout."""
    out = out or (lambda line: print(line, file=sys.stderr, flush=True))
    done = threading.Event()
    failure: list[str] = []

    def watch() -> None:
        since = None  # when the current stretch of pending demands began
        while not done.wait(period_s):
            try:
                pending, has = summary()
            except Exception as e:  # noqa: BLE001 - a status query that fails must not break the run
                out(f"resources: could not read the cluster's status ({type(e).__name__}: {e})")
                continue
            if not pending:
                since = None
                continue
            now = time.monotonic()
            since = since if since is not None else now - period_s
            waited = now - since
            line = f"resources: {what} waiting {waited:.0f} s: pending {', '.join(pending)}; {has}"
            if timeout_s and waited >= timeout_s and not done.is_set():
                failure.append(
                    f"resources.wait_timeout_s: {what} waited {waited:.0f} s for resources and gave up: "
                    f"pending {', '.join(pending)}; {has}. Free them, add nodes, lower trainer.num_ranks "
                    f"or rollout.num_workers, or raise resources.wait_timeout_s"
                )
                # A real SIGINT, as a Ctrl-C: ray.get blocked in its C++ wait loop wakes on the signal and
                # raises KeyboardInterrupt; _thread.interrupt_main only trips Python's flag, which that
                # loop never reads (the block waited on forever).
                os.kill(os.getpid(), signal.SIGINT)
                return
            out(line)

    watcher = threading.Thread(target=watch, name="sparkrl-resource-wait", daemon=True)
    watcher.start()
    try:
        yield
    except KeyboardInterrupt:
        if failure:
            raise ResourceWaitTimeout(failure[0]) from None
        raise
    finally:
        done.set()
        watcher.join(timeout=5)
