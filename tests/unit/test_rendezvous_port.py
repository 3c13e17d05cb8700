"""trainer.rendezvous.free_port: a port that binds now, outside the kernel's range for outgoing connections'
local ports (where a connection opened before rank 0 binds it could take it), without moving Python's
seeded random stream."""

from __future__ import annotations

import random
import socket

from trainer.rendezvous import PORT_RANGE, _outgoing_range, free_port


def test_free_ports_bind_and_stay_out_of_the_outgoing_range():
    low, high = _outgoing_range()
    ports = [free_port() for _ in range(50)]
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] and not low <= p <= high for p in ports)
    assert len(set(ports)) > 40  # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("", ports[0]))


def test_free_port_leaves_the_seeded_random_stream_alone():
    random.seed(7)
    expected = random.random()
    random.seed(7)
    free_port()
    assert random.random() == expected
