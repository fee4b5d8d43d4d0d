"""How the blocking scheduler-socket client (kvxferd/wire/scheduler_socket.py) reads an answer:
whole, or in pieces as the bytes arrive, and what it does with bytes past the answer's frame.
The daemon always writes an answer in one piece and nothing after it; a stand-in server
(a thread on a real Unix socket) writes what the daemon never would."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvxferd.v1 import scheduler_pb2
from kvxferd.wire.local import HEADER, answer_frame
from kvxferd.wire.peer_client import RpcFailure
from kvxferd.wire.scheduler_socket import SchedulerSocket

ANSWER = scheduler_pb2.GetTransferResponse(
    status=scheduler_pb2.TransferStatus(transfer_id="t" * 40, request_id="r", nbytes=123)
)


def _serve(path: Path, reply: Callable[[socket.socket, int], None]) -> threading.Thread:
    """Accept one connection; for each request frame, ``reply(conn, call_id)``."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            while True:
                head = conn.recv(HEADER.size, socket.MSG_WAITALL)
                if len(head) < HEADER.size:
                    return
                size, call_id, _ = HEADER.unpack(head)
                conn.recv(size, socket.MSG_WAITALL)
                reply(conn, call_id)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _answer(call_id: int) -> bytes:
    return answer_frame(call_id, grpc.StatusCode.OK, answer=ANSWER.SerializeToString())


@pytest.fixture
def path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "sched.sock"


def _get(client: SchedulerSocket) -> scheduler_pb2.GetTransferResponse:
    req = scheduler_pb2.GetTransferRequest(transfer_id="t")
    out: scheduler_pb2.GetTransferResponse = client.GetTransfer(req, timeout=5)
    return out


@pytest.mark.parametrize("cuts", [(), (HEADER.size,), (3, HEADER.size + 5, HEADER.size + 9)])
def test_an_answer_is_read_whole_or_as_its_pieces_arrive(path: Path, cuts: tuple[int, ...]) -> None:
    def reply(conn: socket.socket, call_id: int) -> None:
        data, at = _answer(call_id), 0
        for cut in (*cuts, None):
            conn.sendall(data[at:cut])
            at = cut if cut is not None else len(data)
            time.sleep(0.01)  # the client reads what has come so far

    _serve(path, reply)
    client = SchedulerSocket(str(path))
    try:
        assert _get(client) == ANSWER
        assert _get(client) == ANSWER  # the connection is reused, in step
    finally:
        client.close()


def test_bytes_past_the_answer_break_the_connection(path: Path) -> None:
    def reply(conn: socket.socket, call_id: int) -> None:
        conn.sendall(_answer(call_id) + b"\x00" * 7)

    _serve(path, reply)
    client = SchedulerSocket(str(path))
    try:
        with pytest.raises(RpcFailure) as err:
            _get(client)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "7 bytes past the answer" in err.value.details()
    finally:
        client.close()
