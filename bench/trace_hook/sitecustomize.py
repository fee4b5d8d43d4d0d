"""Stamp the monotonic clock at the steps of a lease confirmation in every ``kvxferd serve``
started with this directory on ``PYTHONPATH`` and ``KVX_TRACE_DIR`` set; at exit each daemon
writes ``$KVX_TRACE_DIR/trace-<role>-<pid>.json`` (role ``decode``: the daemon with a
scheduler socket; else ``owner``). Both daemons of one host share the clock
(CLOCK_MONOTONIC), so ``python -m bench.trace_report DIR`` lines a reader's confirmation up with
the owner's handling of it. Steps stamped (wrapped here, nothing changes in kvxferd):

* ``sent``: the reader's LocalTransport writes a ConfirmLease frame;
* ``frame_in``: a socket server's connection receives bytes (``Calls.data_received``);
* ``serve_start`` / ``serve_end``: a call's handler task starts / its answer has been written;
* ``answer_in``: the reader's connection receives bytes (``_Answers.data_received``);
* ``hold_end``: the owner's Engine Hold handler returned (the call before each pull's).

For studies only: wrapping adds a few microseconds per step.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("KVX_TRACE_DIR", "")
STAMPS: dict[str, list[float]] = {}


def _stamp(name: str) -> None:
    STAMPS.setdefault(name, []).append(time.monotonic())


def _wrap_sync(cls: Any, attr: str, name: str) -> None:
    inner = getattr(cls, attr)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stamp(name)
        return inner(*args, **kwargs)

    setattr(cls, attr, wrapper)


def _install() -> None:
    from kvxferd.service import engine_service, local_calls, local_peer
    from kvxferd.wire import local

    _wrap_sync(local_calls.Calls, "data_received", "frame_in")
    _wrap_sync(local._Answers, "data_received", "answer_in")

    serve = local_peer.LocalPeerServer._serve

    async def traced_serve(self: Any, *args: Any, **kwargs: Any) -> None:
        _stamp("serve_start")
        await serve(self, *args, **kwargs)
        _stamp("serve_end")

    local_peer.LocalPeerServer._serve = traced_serve  # type: ignore[method-assign]

    call = local.LocalTransport.__call__

    async def traced_call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "ConfirmLease":
            _stamp("sent")
        return await call(self, method, *args, **kwargs)

    local.LocalTransport.__call__ = traced_call  # type: ignore[method-assign]

    hold = engine_service.EngineService.Hold

    async def traced_hold(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await hold(self, *args, **kwargs)
        finally:
            _stamp("hold_end")

    engine_service.EngineService.Hold = traced_hold  # type: ignore[method-assign]


def _dump() -> None:
    if "serve" not in sys.argv:
        return  # another process that inherited the environment
    role = "decode" if "scheduler_socket" in " ".join(sys.argv) else "owner"
    with open(os.path.join(_DIR, f"trace-{role}-{os.getpid()}.json"), "w") as f:
        json.dump(STAMPS, f)


if _DIR:
    _install()
    atexit.register(_dump)
