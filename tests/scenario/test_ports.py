"""free_ports (kvxferd/scenario/ports.py): ports for a program that binds the port it is
given (vLLM's NIXL side channel), distinct, free, and below the kernel's ephemeral range where
one is free there, so that no bind to port 0 or outgoing connection can take one meanwhile."""

from __future__ import annotations

import random
import socket

import pytest

from kvxferd.scenario import ports as port_mod
from kvxferd.scenario.ports import LOW_PORTS, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = free_ports(8, random.Random(3))
    assert len(set(ports)) == 8
    top = min(LOW_PORTS[1], port_mod._ephemeral_low())
    assert all(LOW_PORTS[0] <= p < top for p in ports), ports
    held = []
    try:
        for p in ports:  # each can be bound now, as the program will
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in held:
            s.close()


def test_a_taken_port_is_never_given() -> None:
    rng = random.Random(5)
    first = rng.randrange(LOW_PORTS[0], min(LOW_PORTS[1], port_mod._ephemeral_low()))
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", first))
        except OSError:
            pytest.skip(f"port {first} is in use on this machine")
        assert first not in free_ports(1, random.Random(5))  # the same first candidate


def test_without_a_free_low_port_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(port_mod, "_ephemeral_low", lambda: LOW_PORTS[0])  # no low range
    ports = free_ports(2)
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)
