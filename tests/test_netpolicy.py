"""PeerAllowList (peers.allow): properties over generated entries and addresses, and examples."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.config import load_config
from kvxferd.errors import ConfigError
from kvxferd.netpolicy import PeerAllowList, parse_address

ports = st.integers(min_value=1, max_value=65535)
ipv4 = st.ip_addresses(v=4)
ipv6 = st.ip_addresses(v=6)
ips = st.one_of(ipv4, ipv6)
label = st.from_regex(r"\A[a-z][a-z0-9-]{0,10}[a-z0-9]\Z")
hostnames = st.lists(label, min_size=1, max_size=4).map(".".join)


def fmt(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def canonical(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@st.composite
def networks(draw: st.DrawFn) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    ip = draw(ips)
    prefix = draw(st.integers(0, ip.max_prefixlen))
    return ipaddress.ip_network(f"{ip}/{prefix}", strict=False)


@st.composite
def entries(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["ip", "net", "name", "ip:port", "name:port"]))
    if kind == "ip":
        return str(draw(ips))
    if kind == "net":
        return str(draw(networks()))
    if kind == "name":
        return draw(hostnames)
    if kind == "ip:port":
        return fmt(draw(ips), draw(ports))
    return f"{draw(hostnames)}:{draw(ports)}"


addresses = st.one_of(
    st.builds(fmt, ips, ports),
    st.builds(lambda h, p: f"{h}:{p}", hostnames, ports),
    st.text(max_size=40),
)


@given(st.text(max_size=60))
def test_empty_list_allows_everything(address: str) -> None:
    assert PeerAllowList.parse("").allows(address)
    assert PeerAllowList.parse([]).allows(address)


@given(st.lists(entries(), min_size=1, max_size=6), st.text(max_size=60))
def test_allows_never_raises_on_any_text(spec: list[str], address: str) -> None:
    allowed = PeerAllowList.parse(",".join(spec)).allows(address)
    if parse_address(address) is None:
        assert not allowed


@given(networks(), ips, ports)
def test_cidr_matches_exactly_its_addresses_on_any_port(
    net: ipaddress.IPv4Network | ipaddress.IPv6Network,
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
    port: int,
) -> None:
    """IPv4-mapped addresses are compared as IPv4: an IPv6 network never matches them."""
    allow = PeerAllowList.parse(str(net))
    addr = canonical(ip)
    assert allow.allows(fmt(ip, port)) == (addr.version == net.version and addr in net)


@given(ips, ports, ports)
def test_ip_entry_any_port_and_ip_port_entry_that_port_only(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, other: int
) -> None:
    assert PeerAllowList.parse(str(ip)).allows(fmt(ip, other))
    pinned = PeerAllowList.parse(fmt(ip, port))
    assert pinned.allows(fmt(ip, port))
    assert pinned.allows(fmt(ip, other)) == (port == other)


@given(hostnames, ports, st.booleans())
def test_host_names_match_literally_ignoring_case_and_trailing_dot(
    name: str, port: int, dot: bool
) -> None:
    allow = PeerAllowList.parse(name.upper() + ("." if dot else ""))
    assert allow.allows(f"{name}:{port}")
    assert allow.allows(f"{name.upper()}.:{port}")
    assert not allow.allows(f"x{name}:{port}")
    assert not allow.allows(f"{name}.evil.example:{port}")


@given(
    st.lists(entries(), min_size=1, max_size=4),
    st.lists(entries(), min_size=1, max_size=4),
    addresses,
)
def test_union_of_lists_allows_the_union(a: list[str], b: list[str], address: str) -> None:
    la, lb, both = (PeerAllowList.parse(x) for x in (a, b, a + b))
    assert both.allows(address) == (la.allows(address) or lb.allows(address))


@given(st.lists(entries(), min_size=1, max_size=6))
def test_every_plain_entry_allows_itself(spec: list[str]) -> None:
    allow = PeerAllowList.parse(spec)
    for entry in spec:
        if "/" in entry:
            net = ipaddress.ip_network(entry)
            target = fmt(net.network_address, 80)
            if canonical(net.network_address).version != net.version:
                continue  # an IPv4-mapped IPv6 network: its addresses count as IPv4
        elif parse_address(entry) is not None:
            target = entry
        else:
            target = f"[{entry}]:80" if ":" in entry else f"{entry}:80"
        assert allow.allows(target), (entry, target)


@given(st.lists(entries(), min_size=1, max_size=6), addresses)
def test_parse_of_str_round_trips(spec: list[str], address: str) -> None:
    allow = PeerAllowList.parse(spec)
    again = PeerAllowList.parse(str(allow))
    assert again.entries == allow.entries
    assert again.allows(address) == allow.allows(address)


@pytest.mark.parametrize(
    ("spec", "allowed", "denied"),
    [
        ("localhost", ["localhost:1", "LOCALHOST:2"], ["127.0.0.1:1", "[::1]:1"]),
        ("127.0.0.1", ["127.0.0.1:5", "[::ffff:127.0.0.1]:5"], ["localhost:5", "127.0.0.2:5"]),
        ("[fd00::1]:9", ["[fd00::1]:9", "[FD00:0::1]:9"], ["[fd00::1]:8", "fd00::1:9"]),
        (
            "10.0.0.0/8",
            ["10.255.0.1:1"],
            ["dns:///10.0.0.1:1", "ipv4:10.0.0.1:1,6.6.6.6:1", "10.0.0.1", "10.0.0.1:0"],
        ),
        ("a.example", ["a.example:1"], ["010.0.0.1:1", "a.example:x", "unix:/tmp/a.example"]),
    ],
)
def test_examples(spec: str, allowed: list[str], denied: list[str]) -> None:
    allow = PeerAllowList.parse(spec)
    for a in allowed:
        assert allow.allows(a), a
    for a in denied:
        assert not allow.allows(a), a


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("10.0.0.1/8", "10.0.0.0/8"),
        ("10.0.0.0/33", "not a valid CIDR"),
        ("10.0.0.0/8:50051", "no port"),
        ("10.0.0.256", "IP address"),
        ("host:0", "1..65535"),
        ("host:99999", "1..65535"),
        ("[10.0.0.1]", "IPv6"),
        ("[fd00::1", "brackets"),
        ("*.svc", "host name"),
        ("10.0.0.1,,10.0.0.2", "empty entry"),
        (" , ", "empty entry"),
    ],
)
def test_bad_entries_name_peers_allow(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        PeerAllowList.parse(spec)
    assert ei.value.field == "peers.allow"
    assert needle in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(None, env={}, overrides={"peers.allow": spec})
    assert ei.value.field == "peers.allow"


def test_toml_array_and_string_load_the_same(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[peers]\nallow = ["10.0.0.0/16", "prefill-0:50051", "[fd00::1]:7"]\n')
    cfg = load_config(p, env={})
    assert PeerAllowList.parse(cfg.peers.allow).entries == (
        PeerAllowList.parse("10.0.0.0/16,prefill-0:50051,[fd00::1]:7").entries
    )
    p.write_text("[peers]\nallow = [1, 2]\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, env={})
    assert ei.value.field == "peers.allow"
