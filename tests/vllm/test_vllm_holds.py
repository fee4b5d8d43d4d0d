"""Hold on a wedged daemon (kvxferd/vllm/holds.py): ``request_finished`` runs on vLLM's
scheduler loop and waits for every rank's Hold, so a daemon that accepts the call and never
answers must cost each finished prompt at most ``HOLD_TIMEOUT_S``, not the generic 30 s call
timeout; the rank is then reported unheld (its prompt counts as sent at once).

The wedged daemon is a Unix socket that accepts connections and never says a word (a stopped
or stuck process looks like this to its client).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from kvxferd.vllm.holds import HOLD_TIMEOUT_S, RankHolds
from kvxferd.vllm.params import HeldBlocks


def test_a_hold_on_a_daemon_that_never_answers_gives_up_soon(tmp_path: Path) -> None:
    path = str(tmp_path / "wedged.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])  # kept open, never answered
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    holds = RankHolds([path], ttl_ms=10_000)
    try:
        t0 = time.monotonic()
        out = holds.hold("wedged-1", HeldBlocks(ids=((1, 2, 3),), starts=(0,)), 48)
        took = time.monotonic() - t0
        assert out.ticket is None and out.unheld == (0,)
        assert took < HOLD_TIMEOUT_S + 3.0, took  # not the 30 s of other calls
        assert HOLD_TIMEOUT_S <= 10.0
        assert out.errors and "TP rank 0" in out.errors[0]
    finally:
        holds.close()
        stop.set()
        t.join(5)
        for conn in accepted:
            conn.close()
        server.close()
