"""Where the trainer ranks meet: rank 0's node, as Ray reports it, and a port free there.

Its own small module (ray and socket only) because Ray runs `node_endpoint` as a task in a fresh worker
process, which imports the module the function lives in: trainer.group would pull in torch and
transformers first."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

import ray

# Below the kernel's range for the local ports of outgoing connections (32768-60999 by default) and above
# Ray's worker ports (10002-19999): a port taken from bind(0) lies in the kernel's range, where any
# connection opened before rank 0 binds it can take it (EADDRINUSE at the rendezvous).
PORT_RANGE = (20000, 32768)


def _outgoing_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bound(port: int) -> int | None:
    """The port a socket bound to `port` gets (0: the kernel's choice), None where it is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return None
        return s.getsockname()[1]


def free_port() -> int:
    """A port free on this machine now, outside the range the kernel hands outgoing connections (drawn with
    `secrets`, so no seeded random stream moves); bind(0)'s choice where that range leaves none."""
    low, high = _outgoing_range()
    candidates = [p for p in range(*PORT_RANGE) if not low <= p <= high]
    for _ in range(64 if candidates else 0):
        port = _bound(candidates[secrets.randbelow(len(candidates))])
        if port is not None:
            return port
    port = _bound(0)
    if port is None:
        raise OSError("free_port: no TCP port can be bound on this machine")
    return port


def node_address() -> tuple[str, str]:
    """(node id, the address Ray reports for this node), from where it runs."""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def node_endpoint() -> tuple[str, int]:
    """(the address Ray reports for this node, a port free on it), from where it runs."""
    return ray.util.get_node_ip_address(), free_port()


def rank0_endpoint(rank0_options: dict) -> tuple[str, int]:
    """`node_endpoint` of the node that rank 0's actor options (its resources, its placement-group bundle)
    place it on: a task of the same shape runs there first. The port is free when the task looks; rank 0
    binds it seconds later."""
    from rl.core import resource_wait

    return resource_wait.get(ray.remote(node_endpoint).options(**rank0_options).remote())
