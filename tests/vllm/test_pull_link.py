"""The vLLM connector's pulls (kvxferd/vllm/pull_link.py) against real daemons, without vLLM:
on the decode daemon's scheduler socket when Describe names one (one StartPull with ``wait``),
over gRPC with WatchTransfers when it does not, and over gRPC again when the socket named is
gone. Each way the worker hears one terminal result with the daemon's own words, and the bytes
arrive."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.vllm.pull_link import PullLink, PullResult
from tests.service.conftest import Daemons, launch

WAIT_S = 30.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("pull-link"),
        DaemonOptions("prefill", "dense:num_blocks=48", fill_seed=9),
        DaemonOptions("decode", "dense:num_blocks=48", scheduler_socket=True),
    )
    yield ds
    ds.stop()


def _client(ds: Daemons, name: str) -> DaemonClient:
    d = ds[name]
    return DaemonClient(name, d.grpc, d.engine_socket)


def _pull(ds: Daemons, link: PullLink, rid: str, remote: list[int], local: list[int]) -> PullResult:
    prefill = _client(ds, "prefill")
    try:
        hold = prefill.hold(rid, [np.array(remote, np.int64)])
    finally:
        prefill.close()
    done: queue.Queue[PullResult] = queue.Queue()
    link.start(
        f"{rid}-pull",
        rid,
        hold.peer_address,
        [list(hold.remote_block_ids.groups[0].ids)],
        [local],
        deadline_ms=20_000,
        on_done=done.put,
    )
    result = done.get(timeout=WAIT_S)
    assert done.empty()  # one result per pull
    return result


def _same_bytes(ds: Daemons, remote: list[int], local: list[int]) -> bool:
    a, b = _client(ds, "prefill"), _client(ds, "decode")
    try:
        return a.checksum(0, remote) == b.checksum(0, local)
    finally:
        a.close()
        b.close()


def _socket(ds: Daemons) -> str:
    dec = _client(ds, "decode")
    try:
        path = dec.describe().scheduler_socket  # what the connector reads at attach
    finally:
        dec.close()
    assert path
    return path


@pytest.mark.parametrize("way", ["socket", "grpc", "socket gone"])
def test_a_pull_ends_done_with_the_right_bytes(pair: Daemons, way: str, tmp_path: Path) -> None:
    socket = {"socket": _socket(pair), "grpc": "", "socket gone": str(tmp_path / "gone.sock")}
    link = PullLink(pair["decode"].grpc, socket=socket[way])
    k = ["socket", "grpc", "socket gone"].index(way)
    remote, local = [4 + k, 17 + k, 2 + k, 30 + k], [40 + k, 8 + k, 1 + k, 22 + k]
    try:
        r = _pull(pair, link, f"pl-{way.replace(' ', '-')}", remote, local)
    finally:
        link.close()
    assert r.state == "DONE", r.error
    assert r.nbytes > 0 and r.invalid_local == () and r.local == (tuple(local),)
    assert _same_bytes(pair, remote, local)


@pytest.mark.parametrize("way", ["socket", "grpc"])
def test_a_refused_pull_is_reported_refused_with_the_daemons_reason(
    pair: Daemons, way: str
) -> None:
    link = PullLink(pair["decode"].grpc, socket=_socket(pair) if way == "socket" else "")
    try:
        r = _pull(pair, link, f"pl-refused-{way}", [45, 46], [7, 480])  # 480: past the 48 blocks
    finally:
        link.close()
    assert r.state == "REFUSED"
    assert "480" in r.error and "INVALID_ARGUMENT" in r.error, r.error
    assert r.local == ((7, 480),)
