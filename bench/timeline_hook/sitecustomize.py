"""Stamp the monotonic clock at the steps of every pull in the daemons (``kvxferd serve``)
started with this directory on ``PYTHONPATH`` and ``KVX_TIMELINE_DIR`` set; at exit each writes
``$KVX_TIMELINE_DIR/timeline-<role>-<pid>.json`` (role ``decode``: the daemon with a scheduler
socket; else ``owner``). With pulls made one at a time (``bench.control_path``),
``python -m bench.timeline_report DIR`` cuts the stamps into one window per StartPull frame and
prints each step's p50 offset from the frame's arrival: where a pull's time goes on the decode
daemon's one thread, loop turns included, and on the owner's (its steps prefixed ``owner:``;
both daemons of one host share the clock).

For studies only: each stamp adds about a microsecond; nothing in kvxferd changes.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("KVX_TIMELINE_DIR", "")
STAMPS: list[tuple[str, float]] = []
_now = time.monotonic


def _stamp(name: str) -> None:
    STAMPS.append((name, _now()))


def _wrap(path: str, attr: str, label: str, *, exit_: bool = True) -> None:
    mod_name, _, cls_name = path.rpartition(":")
    owner: Any = importlib.import_module(mod_name)
    for part in cls_name.split(".") if cls_name else ():
        owner = getattr(owner, part)
    inner = getattr(owner, attr)
    if inspect.iscoroutinefunction(inner):

        @functools.wraps(inner)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            _stamp(label + ">")
            try:
                return await inner(*args, **kwargs)
            finally:
                if exit_:
                    _stamp(label + "<")

        setattr(owner, attr, awrapper)
    else:

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _stamp(label + ">")
            try:
                return inner(*args, **kwargs)
            finally:
                if exit_:
                    _stamp(label + "<")

        setattr(owner, attr, wrapper)


def _install() -> None:
    _wrap("kvxferd.service.local_calls:Calls", "data_received", "frame_in")
    _wrap("kvxferd.service.local_peer:LocalPeerServer", "_serve", "serve")
    _wrap("kvxferd.service.scheduler_service:SchedulerService", "StartPull", "StartPull")
    _wrap("kvxferd.daemon.reader:Reader", "start_pull", "start_pull")
    _wrap("kvxferd.wire.local:LocalTransport", "__call__", "peer_call")
    _wrap("kvxferd.wire.local:_Answers", "data_received", "answer_in")
    _wrap("kvxferd.daemon.shares:Shares", "confirm", "confirm")
    _wrap("kvxferd.daemon.moves:Mover", "plan", "plan")
    _wrap("kvxferd.daemon.moves:Mover", "choose", "choose")
    _wrap("kvxferd.daemon.moves:Mover", "prepare", "prepare")
    _wrap("kvxferd.daemon.pulls:PullBook", "add", "book_add")
    _wrap("kvxferd.daemon.reader:Reader", "_run_pull", "run_pull")
    _wrap("kvxferd.daemon.moves:Mover", "move", "move")
    _wrap("kvxferd.ipc.reader:KernelReader", "_launch", "launch")
    _wrap("kvxferd.ipc.reader:", "wait_event", "wait_event")
    _wrap("kvxferd.ipc.reader:", "run_copy", "run_copy")
    _wrap("kvxferd.kernels.cuda_ops:", "run_copy", "cuda_run_copy")
    _wrap("kvxferd.daemon.reader:Reader", "_settle", "settle")
    from kvxferd.nixl import worker

    call = worker.NixlThread.call

    def traced_call(self: Any, fn: Any, *args: Any) -> Any:
        # Named by the function called, and whether the caller is the NIXL thread itself.
        label = f"nixl_call:{getattr(fn, '__name__', '?')}{'' if self.on_thread else '@loop'}"
        _stamp(label + ">")
        try:
            return call(self, fn, *args)
        finally:
            _stamp(label + "<")

    worker.NixlThread.call = traced_call  # type: ignore[method-assign]
    _wrap("kvxferd.service.peer_service:PeerService", "ConfirmLease", "ConfirmLease")
    # DIRECT (session 19): the hand-off to the NIXL thread, its post, the end and the hand-back.
    _wrap("kvxferd.transfer.engine:TransferEngine", "submit_prepared", "submit")
    _wrap("kvxferd.transfer.inflight:InFlight", "post", "nixl_post")
    _wrap("kvxferd.transfer.inflight:InFlight", "finish", "finish")
    _wrap("kvxferd.transfer.inflight:Transfer", "wait", "xfer_wait")
    from kvxferd.kernels import cuda_ops

    find = cuda_ops._op

    def timed_op(name: str) -> Any:
        op = find(name)

        def call(*args: Any) -> Any:
            _stamp("op>")
            try:
                return op(*args)
            finally:
                _stamp("op<")

        return call

    cuda_ops._op = timed_op  # type: ignore[assignment]
    from kvxferd.daemon import pulls

    mark = pulls.Stages.mark

    def traced_mark(self: Any, name: str) -> Any:
        _stamp("mark:" + name)
        return mark(self, name)

    pulls.Stages.mark = traced_mark  # type: ignore[method-assign]
    update = pulls.PullBook.update

    def traced_update(self: Any, transfer_id: str, **changes: Any) -> Any:
        state = changes.get("state")
        _stamp(f"update:{state.value if state is not None else '-'}")
        return update(self, transfer_id, **changes)

    pulls.PullBook.update = traced_update  # type: ignore[method-assign]
    import gc

    def traced_gc(phase: str, info: dict[str, int]) -> None:
        _stamp(f"gc{info.get('generation', '?')}{'>' if phase == 'start' else '<'}")

    gc.callbacks.append(traced_gc)


def _dump() -> None:
    if "serve" not in sys.argv:
        return  # another process that inherited the environment
    role = "decode" if "scheduler_socket" in " ".join(sys.argv) else "owner"
    with open(os.path.join(_DIR, f"timeline-{role}-{os.getpid()}.json"), "w") as f:
        json.dump(STAMPS, f)


if _DIR:
    _install()
    atexit.register(_dump)
