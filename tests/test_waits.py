"""The test helpers' port picks (omnistage.testing.waits)."""

from __future__ import annotations

import socket

from omnistage.testing.waits import free_ports


def test_ports_picked_together_are_distinct_and_bindable():
    """Ray refuses a node given one port twice; separately picked ports can repeat."""
    ports = free_ports(64)
    assert len(set(ports)) == 64
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))  # released for the caller
