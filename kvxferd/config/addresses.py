"""Listen addresses: ``host:port`` (IPv6 as ``[addr]:port``) and whether a host is loopback."""

from __future__ import annotations

import ipaddress

from kvxferd.errors import ConfigError


def split_hostport(addr: str, key: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[addr]:port``) as (host without brackets, port 0..65535)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit():
        raise ConfigError(
            f"{addr!r} is not host:port",
            field=key,
            fix="write e.g. 127.0.0.1:50051 (IPv6: [::1]:50051)",
        )
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1]
        if not (host.startswith("[") and host.endswith("]")) or not _is_ipv6(inner):
            raise ConfigError(
                f"{addr!r}: brackets must hold an IPv6 address",
                field=key,
                fix="write e.g. [::1]:50051 or 127.0.0.1:50051",
            )
        host = inner
    elif ":" in host:
        raise ConfigError(
            f"{addr!r}: an IPv6 address with a port must be in brackets",
            field=key,
            fix=f"write [{host}]:{port}",
        )
    if int(port) > 65535:
        raise ConfigError(
            f"port {port} of {addr!r} is out of range",
            field=key,
            fix="use a port from 1 to 65535 (0 picks a free one)",
        )
    return host, int(port)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["is_loopback", "split_hostport"]
