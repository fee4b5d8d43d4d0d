"""The vLLM connector's pulls (kvxferd/vllm/pull_link.py) against real daemons, without vLLM:
on the decode daemon's scheduler socket when Describe names one (one StartPull with ``wait``),
over gRPC with WatchTransfers when it does not, and over gRPC again when the socket named is
gone. Each way the worker hears one terminal result with the daemon's own words, and the bytes
arrive. A StartPull that got no answer (faked: no daemon needed) is settled, not refused."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from kvxferd.vllm import pull_link
from kvxferd.vllm.pull_link import PullLink, PullResult
from kvxferd.wire.codec import group_ids_to_proto
from kvxferd.wire.peer_client import RpcFailure
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


class _BrokenWatch:
    """The decode daemon's Scheduler stub with its WatchTransfers stream reset at once (a proxy
    or load balancer between the connector and the daemon dropping the stream: a fault we
    cannot cause on demand). Every other call reaches the real daemon."""

    def __init__(self, stub: object) -> None:
        self._stub = stub
        self.watches = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)

    def WatchTransfers(self, *args: object, **kw: object) -> object:  # noqa: N802 (gRPC's name)
        self.watches += 1
        raise grpc.RpcError("the stream was reset by a proxy")


def test_a_pull_whose_watch_breaks_is_reported_only_once_it_has_ended(pair: Daemons) -> None:
    # Reporting it at once (LOST, as before) let vLLM free or recompute blocks the pull may
    # still be writing. The link cancels it and reports its terminal state instead.
    link = PullLink(pair["decode"].grpc)
    broken = _BrokenWatch(link._stub)
    link._stub = broken  # type: ignore[assignment]
    try:
        remote, local = list(range(40)), list(range(47, 7, -1))
        result = _pull(pair, link, "broken-watch", remote, local)
    finally:
        link.close()
    assert broken.watches == 1
    assert result.state in ("CANCELLED", "DONE"), result
    if result.state == "CANCELLED":
        assert sorted(result.invalid_local) == sorted(local), result
        assert "cancelled by a caller" in result.error
    dec = _client(pair, "decode")
    try:  # the daemon says the same: the pull had ended when the worker heard of it
        st = dec.get_transfer(result.transfer_id)
    finally:
        dec.close()
    assert st.finished_unix_ns and st.state != 0


class _Unanswered:
    """A daemon that does not answer StartPull (over gRPC, or on its scheduler socket, which
    breaks mid-call): the pull may be running. ``answers`` GetTransfer statuses follow, each
    call taking the next (an exception is raised, a status answered)."""

    path = "/nowhere/scheduler.sock"

    def __init__(self, start: grpc.StatusCode, answers: list[object]) -> None:
        self.start, self.answers, self.cancels = start, answers, 0

    def call(self, *args: object, **kw: object) -> object:  # the scheduler socket
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the scheduler socket broke", ())

    def close(self) -> None:
        pass

    def StartPull(self, *args: object, **kw: object) -> object:  # noqa: N802 (gRPC's name)
        raise RpcFailure(self.start, "no answer", ())

    def CancelTransfer(self, *args: object, **kw: object) -> object:  # noqa: N802
        self.cancels += 1
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "still unreachable", ())

    def GetTransfer(self, *args: object, **kw: object) -> object:  # noqa: N802
        nxt = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(nxt, Exception):
            raise nxt
        return scheduler_pb2.GetTransferResponse(status=nxt)


@pytest.mark.parametrize(
    ("way", "start"),
    [
        ("socket broke", grpc.StatusCode.UNAVAILABLE),
        ("socket broke", grpc.StatusCode.DEADLINE_EXCEEDED),
        ("grpc", grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
@pytest.mark.parametrize("ends", ["cancelled", "never answers"])
def test_a_pull_whose_start_got_no_answer_is_settled_not_refused(
    monkeypatch: pytest.MonkeyPatch, way: str, start: grpc.StatusCode, ends: str
) -> None:
    # Before, StartPull's no-answer was reported REFUSED at once: vLLM reused (recomputed
    # into, freed) blocks the pull may still have been writing. Now the link cancels it and
    # reports it once it is terminal, or LOST once its deadline has passed.
    monkeypatch.setattr(pull_link, "CALL_TIMEOUT_S", 0.2)
    down = RpcFailure(grpc.StatusCode.UNAVAILABLE, "unreachable", ())
    tid = "vllm-e-r0-dec-1"
    if ends == "cancelled":
        final = scheduler_pb2.TransferStatus(
            transfer_id=tid,
            request_id="cmpl-1",
            state=scheduler_pb2.TRANSFER_STATE_CANCELLED,
            invalid_local_block_ids=group_ids_to_proto([[3, 4]]),
        )
        answers: list[object] = [down, down, final]
    else:
        answers = [down]
    daemon = _Unanswered(start, answers)
    link = PullLink("127.0.0.1:1")
    link._stub = daemon  # type: ignore[assignment]
    if way == "socket broke":
        link._sockets = daemon  # type: ignore[assignment]
    done: queue.Queue[PullResult] = queue.Queue()
    t0 = time.monotonic()
    try:
        link.start(
            tid, "cmpl-1", "10.0.0.5:1", [[7, 8]], [[3, 4]], deadline_ms=300, on_done=done.put
        )
        r = done.get(timeout=WAIT_S)
    finally:
        link.close()
    assert daemon.cancels == 1
    assert r.local == ((3, 4),) and r.transfer_id == tid
    if ends == "cancelled":
        assert r.state == "CANCELLED" and r.invalid_local == (3, 4), r
    else:  # unreachable throughout: reported only after the deadline (300 ms) has passed
        assert r.state == "LOST" and time.monotonic() - t0 >= 0.3, r
        assert "no answer" in r.error
