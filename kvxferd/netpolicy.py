"""Which peer addresses this daemon may connect to and send its credentials to (``peers.allow``).

A :class:`PeerAllowList` is built once from the configuration and asked, before any channel is
opened, whether a scheduler-named peer address may be used. It is pure: no DNS lookups, no I/O.

Entries (comma-separated in a string, or a TOML array):

* an IP address (``10.0.0.12``, ``fd00::12``, ``[fd00::12]``): that address, any port;
* a CIDR (``10.0.0.0/16``, ``fd00::/64``): any address inside it, any port; a CIDR with host
  bits set (``10.0.1.7/16``) is refused as ambiguous;
* a host name (``prefill-0.kvxferd.svc``): that exact name, compared case-insensitively and
  without a trailing dot, any port. Names are never resolved, so a name entry never matches a
  peer named by IP address, nor an IP entry a peer named by host name; ``localhost`` is an
  ordinary name (it does not match ``127.0.0.1`` nor the reverse);
* any of the above but a CIDR with ``:port`` (IPv6 in brackets: ``[fd00::12]:50051``): that
  host on that port only.

An empty list allows every address (the default: no restriction). A non-empty list allows an
address only if it is a plain ``host:port`` (IPv6 in brackets) that some entry matches;
anything else, including gRPC target syntax such as ``dns:///name:port`` or
``ipv4:a:p,b:p``, is refused. IPv4-mapped IPv6 addresses (``::ffff:10.0.0.1``) are compared
as the IPv4 address they carry.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvxferd.errors import ConfigError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

KEY = "peers.allow"
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_DIGITS = re.compile(r"^[0-9]{1,5}$")


@dataclass(frozen=True)
class AllowEntry:
    """One parsed entry: an IP network (a single address is a /32 or /128) or a host name,
    with an optional port."""

    network: IPNetwork | None
    host: str
    port: int | None

    def matches(self, host: str | IPAddress, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            return not isinstance(host, str) and host in self.network
        return isinstance(host, str) and host == self.host

    def __str__(self) -> str:
        if self.network is None:
            base = self.host
        elif self.network.num_addresses == 1:
            addr = self.network.network_address
            base = f"[{addr}]" if addr.version == 6 and self.port is not None else str(addr)
        else:
            base = str(self.network)
        return base if self.port is None else f"{base}:{self.port}"


class PeerAllowList:
    """The peer addresses this daemon may use; empty allows every address."""

    def __init__(self, entries: Iterable[AllowEntry] = ()) -> None:
        self._entries = tuple(entries)

    @classmethod
    def parse(cls, spec: str | Iterable[str]) -> PeerAllowList:
        """Parse ``peers.allow``: a comma-separated string or a sequence of entries.

        Raises :class:`ConfigError` (field ``peers.allow``) naming the first bad entry. A blank
        string or an empty sequence gives the empty list; an empty entry inside a non-blank
        list (``"10.0.0.1,,10.0.0.2"``) is refused rather than silently skipped.
        """
        if isinstance(spec, str):
            if not spec.strip():
                return cls()
            items: list[str] = spec.split(",")
        else:
            items = list(spec)
        for item in items:
            if not item.strip():
                raise ConfigError(
                    f"empty entry in {spec if isinstance(spec, str) else items!r}",
                    field=KEY,
                    fix="remove the stray comma or empty string; list IPs, CIDRs, host names or"
                    " host:port separated by commas (docs/config.md)",
                )
        return cls(_parse_entry(item) for item in items)

    @property
    def entries(self) -> tuple[AllowEntry, ...]:
        return self._entries

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __str__(self) -> str:
        return ",".join(str(e) for e in self._entries)

    def __repr__(self) -> str:
        return f"PeerAllowList({str(self)!r})"

    def allows(self, address: str) -> bool:
        """Whether this daemon may connect to ``address`` (``host:port``, IPv6 as
        ``[addr]:port``). Never raises; an address that is not plain ``host:port`` is refused
        unless the list is empty."""
        if not self._entries:
            return True
        parsed = parse_address(address)
        if parsed is None:
            return False
        host, port = parsed
        return any(e.matches(host, port) for e in self._entries)


def parse_address(address: str) -> tuple[str | IPAddress, int] | None:
    """``host:port`` as (IP address or lower-case host name, port), or None if it is not one."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not _DIGITS.match(port_text):
        return None
    port = int(port_text)
    if not 0 < port <= 65535:
        return None
    if host.startswith("["):
        if not host.endswith("]"):
            return None
        v6 = _ipv6(host[1:-1])
        return (v6, port) if v6 is not None else None
    if ":" in host:
        return None  # IPv6 without brackets is ambiguous with the port
    ip = _ip(host)
    if ip is not None:
        return ip, port
    name = _hostname(host)
    return (name, port) if name is not None else None


def _ipv6(text: str) -> IPAddress | None:
    """An IPv6 address as written in brackets (IPv4-mapped: its IPv4 address), or None."""
    try:
        ip = ipaddress.IPv6Address(text)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip


def _ip(text: str) -> IPAddress | None:
    """An IP address (IPv4-mapped IPv6 as its IPv4 address), or None."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _hostname(text: str) -> str | None:
    """A valid DNS host name, lower-cased without its trailing dot, or None.

    A name whose last label is all digits (``10.0.0.300``, ``010.1.2.3``, ``167772161``) is not
    a host name: resolvers may read it as an IPv4 address in some other notation."""
    name = text.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253:
        return None
    labels = name.split(".")
    if not all(_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        return None
    return name


def _parse_entry(raw: str) -> AllowEntry:
    text = raw.strip()
    if "/" in text:
        return AllowEntry(_network(text), "", None)
    host, port = text, None
    if text.startswith("["):
        close = text.find("]")
        rest = text[close + 1 :] if close > 0 else ""
        if close < 0 or (rest and not rest.startswith(":")):
            raise _bad(text, "an IPv6 address in brackets is written [fd00::1] or [fd00::1]:50051")
        host, port = text[1:close], _port(rest[1:], text) if rest else None
        ip = _ipv6(host)
        if ip is None:
            raise _bad(text, "brackets hold an IPv6 address only")
        return AllowEntry(ipaddress.ip_network(ip), "", port)
    if text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _port(port_text, text)
    ip = _ip(host)
    if ip is not None:
        return AllowEntry(ipaddress.ip_network(ip), "", port)
    name = _hostname(host)
    if name is None:
        raise _bad(
            text,
            "write an IP address, a CIDR (10.0.0.0/16), a host name or host:port;"
            " IPv6 with a port goes in brackets ([fd00::1]:50051)",
        )
    return AllowEntry(None, name, port)


def _network(text: str) -> IPNetwork:
    if re.search(r"/[0-9]+:", text):
        raise _bad(text, "a CIDR entry takes no port; list the network alone")
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        try:
            loose = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise _bad(text, f"not a valid CIDR ({exc}); write e.g. 10.0.0.0/16") from exc
        raise _bad(
            text, f"has host bits set; write {loose} for the network, or the address alone"
        ) from exc


def _port(text: str, entry: str) -> int:
    if not _DIGITS.match(text) or not 0 < int(text) <= 65535:
        raise _bad(entry, f"port {text!r} is not in 1..65535")
    return int(text)


def _bad(entry: str, why: str) -> ConfigError:
    return ConfigError(
        f"entry {entry!r} is not an IP address, CIDR, host name or host:port: {why}",
        field=KEY,
        fix="correct the entry (docs/config.md, peers.allow)",
    )


__all__ = ["AllowEntry", "PeerAllowList", "parse_address"]
