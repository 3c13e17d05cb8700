"""Where the trainer ranks meet: rank 0's node, as Ray reports it, and a port free there.

Its own small module (ray and socket only) because Ray runs `node_endpoint` as a task in a fresh worker
process, which imports the module the function lives in: trainer.group would pull in torch and
transformers first."""

from __future__ import annotations

import socket

import ray


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
    from rl import resource_wait

    return resource_wait.get(ray.remote(node_endpoint).options(**rank0_options).remote())
