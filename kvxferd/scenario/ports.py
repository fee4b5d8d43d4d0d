"""TCP ports for programs that bind the port they are given (vLLM's NIXL side channel, a
daemon restarted on the address its peers know): :func:`free_ports`.

A port picked by binding port 0 and closing comes from the kernel's ephemeral range, where
any other bind to port 0 or outgoing connection may take it before the program binds it (in CI,
a vLLM engine's side channel found its port taken so). Ports below that range are never given
out that way.
"""

from __future__ import annotations

import random
import socket

# Where free_ports looks first: below the kernel's ephemeral range (ports a bind to port 0 or an
# outgoing connection may take at any moment), above the well-known and registered services.
LOW_PORTS = (20000, 32000)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now, for a program that binds the port it is
    given (vLLM's NIXL side channel). Taken below the ephemeral range where one is free there:
    between this check and the program's bind, no bind to port 0 and no outgoing connection can
    take such a port (one in the ephemeral range was taken so, in CI). Every candidate is held
    bound until all ``n`` are found, so no two are the same."""
    rng = rng or random.Random()
    held: list[socket.socket] = []
    try:
        top = min(LOW_PORTS[1], _ephemeral_low())
        for _ in range(200):
            if len(held) == n or top <= LOW_PORTS[0]:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(LOW_PORTS[0], top)))
            except OSError:
                s.close()
                continue
            held.append(s)
        while len(held) < n:  # nothing free down there: the kernel's choice
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]


__all__ = ["LOW_PORTS", "free_port", "free_ports"]
