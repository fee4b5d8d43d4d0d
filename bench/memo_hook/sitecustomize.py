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

from typing import Any

import kvxferd.daemon.moves as _moves
from kvxferd.ipc.reader import ReadyPull

_Mover: Any = _moves.Mover
_plan, _choose, _prepare = _Mover.plan, _Mover.choose, _Mover.prepare
_MEMO: dict[tuple[object, ...], Any] = {}
MAX = 4096


def _key(kind: str, req: Any, peer: object) -> tuple[object, ...]:
    local = tuple(a.tobytes() for a in req.local_ids)
    remote = tuple(a.tobytes() for a in req.remote_ids)
    return (kind, local, remote, id(peer))


def _hit(key: tuple[object, ...], peer: object, part: object = None) -> Any:
    """The value kept under ``key`` if it was made for this very peer (and plan part)."""
    got = _MEMO.get(key)
    if got is not None and got[0] is peer and got[2] is part:
        return got
    return None


def _put(key: tuple[object, ...], peer: object, value: Any, part: object = None) -> None:
    if len(_MEMO) >= MAX:
        _MEMO.clear()
    _MEMO[key] = (peer, value, part)


def plan(self: Any, req: Any, remote: Any) -> Any:
    key = _key("plan", req, remote)
    got = _hit(key, remote)
    if got is not None:
        return got[1]
    value = _plan(self, req, remote)
    _put(key, remote, value)
    return value


def choose(self: Any, req: Any, link: Any, plan_: Any, part: Any) -> Any:
    key = _key("choose", req, link.remote)
    got = _hit(key, link.remote, part)
    if got is not None:
        return got[1]
    value = _choose(self, req, link, plan_, part)
    _put(key, link.remote, value, part)
    return value


def prepare(self: Any, req: Any, link: Any, part: Any, staged: Any) -> Any:
    key = _key("prepare", req, link.remote)
    got = _hit(key, link.remote, part)
    if got is not None:
        return got[1]
    value = _prepare(self, req, link, part, staged)
    if isinstance(value, ReadyPull):
        _put(key, link.remote, value, part)
    return value


_Mover.plan, _Mover.choose, _Mover.prepare = plan, choose, prepare
