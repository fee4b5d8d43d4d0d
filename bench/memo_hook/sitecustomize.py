"""Take the decode daemon's host work for a pull it has seen before off the pull's path, in every
process started with this directory on ``PYTHONPATH``: the plan, the strategy decision and
KERNEL's checked pieces and launch tables (``Mover.plan``, ``choose``, ``prepare`` in
kvxferd/daemon/moves.py) are kept per (local IDs, remote IDs, peer generation) and handed back
on a repeat. With ``bench.control_path --distinct K`` (the pulls cycle through K ID lists),
every timed pull then costs a dictionary lookup where the host work was: the pull's time with
that work at about zero, the most a compiled planner could give. For studies only:

    PYTHONPATH=bench/memo_hook:. python -m bench.control_path --device cuda --distinct 8

Only what is pure or tied to the peer generation is kept (the plan; the decision, which reads
the link as handshaken; KERNEL's ReadyPull, which names the mappings it was made against and
which the reader refuses for any other); DIRECT's prepared descriptors name the transfer and
are made each time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvxferd.daemon.moves as _moves
from kvxferd.ipc.reader import ReadyPull

_Mover: Any = _moves.Mover
_plan, _choose, _prepare = _Mover.plan, _Mover.choose, _Mover.prepare
_MEMO: dict[tuple[object, ...], Any] = {}
MAX = 4096


def _kept(kind: str, req: Any, peer: object, part: object, make: Callable[[], Any]) -> Any:
    """The value kept for this request (its ID lists), made for this very peer generation (and
    plan part), else ``make()``'s, kept unless it is DIRECT's prepared descriptors (None or a
    transfer's own lists: only KERNEL's ReadyPull is kept of ``prepare``)."""
    key = (
        kind,
        tuple(a.tobytes() for a in req.local_ids),
        tuple(a.tobytes() for a in req.remote_ids),
    )
    got = _MEMO.get(key)
    if got is not None and got[0] is peer and got[2] is part:
        return got[1]
    value = make()
    if kind != "prepare" or isinstance(value, ReadyPull):
        if len(_MEMO) >= MAX:
            _MEMO.clear()
        _MEMO[key] = (peer, value, part)
    return value


def plan(self: Any, req: Any, remote: Any) -> Any:
    return _kept("plan", req, remote, None, lambda: _plan(self, req, remote))


def choose(self: Any, req: Any, link: Any, plan_: Any, part: Any) -> Any:
    return _kept("choose", req, link.remote, part, lambda: _choose(self, req, link, plan_, part))


def prepare(self: Any, req: Any, link: Any, part: Any, staged: Any) -> Any:
    return _kept("prepare", req, link.remote, part, lambda: _prepare(self, req, link, part, staged))


_Mover.plan, _Mover.choose, _Mover.prepare = plan, choose, prepare
