"""The book of pulls: each pull's status as a value, revisioned, with watchers.

Runs on the daemon's event loop only (no locks). Watchers get every change of the pulls they
watch through their own queue, so a slow watcher never blocks a pull.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.expand import logical_blocks_of
from kvxferd.daemon.backlog import WATCH_BACKLOG, Backlog
from kvxferd.errors import InvalidRequest, KvxferdError, NotFound
from kvxferd.staging.stats import StageTimes
from kvxferd.transfer import notify

Int64Array = npt.NDArray[np.int64]


class PullState(enum.Enum):
    PENDING = "PENDING"
    HANDSHAKING = "HANDSHAKING"
    CONFIRMING = "CONFIRMING"
    TRANSFERRING = "TRANSFERRING"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset((PullState.DONE, PullState.FAILED, PullState.CANCELLED, PullState.EXPIRED))


@dataclass(frozen=True)
class PullRecord:
    """A snapshot of one pull. ``invalid_local_blocks``: per group, local kernel block IDs
    (:meth:`invalid_logical` gives them as the proto's logical IDs)."""

    transfer_id: str
    request_id: str
    peer_address: str
    state: PullState = PullState.PENDING
    nbytes: int = 0
    naive_descriptors: int = 0
    posted_descriptors: int = 0
    strategy: str = "DIRECT"
    error: KvxferdError | None = None
    invalid_local_blocks: tuple[Int64Array, ...] = field(default=())
    created_ns: int = 0
    started_ns: int = 0
    finished_ns: int = 0
    deadline_ns: int = 0
    revision: int = 0
    strategy_reason: str = ""
    stage_times: StageTimes | None = None
    fingerprint: bytes = b""  # the StartPull request it was made from (idempotent retries)
    stages: tuple[tuple[str, float], ...] = ()  # (stage, seconds) in order; set at the end
    local_ppl: tuple[int, ...] = ()  # per group, this pool's kernel blocks per logical block

    def invalid_logical(self) -> tuple[Int64Array, ...]:
        """The invalid local blocks as logical IDs, per group (those the caller sent)."""
        if not self.local_ppl:
            return self.invalid_local_blocks
        return tuple(
            logical_blocks_of(k, p)
            for k, p in zip(self.invalid_local_blocks, self.local_ppl, strict=True)
        )


_FIELDS = frozenset(f.name for f in dataclasses.fields(PullRecord))


def unix_ns(monotonic_t: float) -> int:
    """A time on the monotonic clock as unix time in ns (for the status's timestamps)."""
    return time.time_ns() + round((monotonic_t - time.monotonic()) * 1e9)


def revised(rec: PullRecord, changes: dict[str, object]) -> PullRecord:
    """``rec`` with ``changes``: what ``dataclasses.replace`` returns, without its generated
    ``__init__`` setting all 20 frozen fields one by one (a pull revises its record ~5 times
    on its hot path). Unknown field names raise ``TypeError``, as ``replace`` does."""
    unknown = changes.keys() - _FIELDS
    if unknown:
        raise TypeError(f"PullRecord has no field {', '.join(sorted(unknown))}")
    new = object.__new__(PullRecord)
    values = new.__dict__
    values.update(rec.__dict__)
    values.update(changes)
    return new


_WATCH_FIX = (
    "read the stream as fast as pulls change, or open it again (its first messages are every"
    " pull's current status) and GetTransfer the pulls it follows"
)


class PullBook:
    """Pulls by transfer ID; keeps the last ``keep_finished`` terminal ones for lookups."""

    def __init__(self, keep_finished: int = 4096, watch_backlog: int = WATCH_BACKLOG) -> None:
        self._pulls: dict[str, PullRecord] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._keep = keep_finished
        self._backlog = watch_backlog
        self._watchers: list[tuple[frozenset[str], Backlog[PullRecord]]] = []
        self._done_events: dict[str, asyncio.Event] = {}  # one per pull not yet terminal
        self._on_end: list[Callable[[PullRecord], None]] = []

    def on_end(self, listener: Callable[[PullRecord], None]) -> None:
        """Call ``listener`` with every pull's terminal record: on the event loop, after the
        callbacks the ending scheduled (a StartPull ``wait`` answers first), or at once when
        no loop runs. A listener is for books (metrics): it must not raise."""
        self._on_end.append(listener)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._pulls

    def add(self, record: PullRecord) -> PullRecord:
        rec = revised(record, {"created_ns": time.time_ns(), "revision": 1})
        self._pulls[rec.transfer_id] = rec
        self._done_events[rec.transfer_id] = asyncio.Event()
        self._publish(rec)
        return rec

    def find(self, transfer_id: str) -> PullRecord | None:
        return self._pulls.get(transfer_id)

    def get(self, transfer_id: str) -> PullRecord:
        rec = self._pulls.get(transfer_id)
        if rec is None:
            raise NotFound(
                f"no transfer {transfer_id!r}",
                field="transfer_id",
                fix="use an ID returned by StartPull (finished pulls are kept for a while)",
            )
        return rec

    def update(self, transfer_id: str, **changes: object) -> PullRecord:
        old = self.get(transfer_id)
        if old.state.terminal:
            return old  # terminal states are final
        changes["revision"] = old.revision + 1
        state = changes.get("state", old.state)
        if isinstance(state, PullState) and state.terminal:
            changes["finished_ns"] = time.time_ns()
        rec = revised(old, changes)
        if rec.state.terminal:
            self._done_events.pop(transfer_id).set()
            self._finished[transfer_id] = None
            while len(self._finished) > self._keep:
                gone, _ = self._finished.popitem(last=False)
                self._pulls.pop(gone, None)
        self._pulls[transfer_id] = rec
        self._publish(rec)
        if rec.state.terminal:
            self._ended(rec)  # last: the book is consistent whatever a listener does
        return rec

    def _ended(self, rec: PullRecord) -> None:
        if not self._on_end:
            return
        try:
            call_soon = asyncio.get_running_loop().call_soon
        except RuntimeError:  # no loop (a synchronous caller): now
            for listener in self._on_end:
                listener(rec)
            return
        for listener in self._on_end:
            call_soon(listener, rec)

    async def wait_terminal(self, transfer_id: str) -> PullRecord:
        ev = self._done_events.get(transfer_id)
        if ev is not None:
            await ev.wait()
        return self.get(transfer_id)

    @property
    def num_active(self) -> int:
        return len(self._done_events)

    def active(self) -> list[PullRecord]:
        return [self._pulls[tid] for tid in self._done_events]

    def watch(self, transfer_ids: frozenset[str]) -> Backlog[PullRecord]:
        """A queue of every future change to ``transfer_ids`` (all pulls when empty), primed
        with the current snapshot of those pulls (every known pull when empty); at most
        ``watch_backlog`` changes unread past the snapshot (kvxferd/daemon/backlog.py)."""
        snapshot = [r for r in map(self._pulls.get, transfer_ids or list(self._pulls)) if r]
        limit = len(snapshot) + self._backlog
        q: Backlog[PullRecord] = Backlog(limit, "WatchTransfers stream", _WATCH_FIX)
        self._watchers.append((transfer_ids, q))
        for rec in snapshot:
            q.put(rec)
        return q

    def unwatch(self, q: Backlog[PullRecord]) -> None:
        self._watchers = [(ids, w) for ids, w in self._watchers if w is not q]

    def _publish(self, rec: PullRecord) -> None:
        for ids, q in self._watchers:
            if not ids or rec.transfer_id in ids:
                q.put(rec)

    def follow(self, transfer_ids: frozenset[str]) -> Follower:
        """Every change of the named pulls (all pulls when empty), after a snapshot of their
        current state; with names, the stream ends once every named pull is terminal. The watch
        is registered when this returns (NotFound for an unknown ID first), so no later change
        is missed; the caller closes it."""
        for tid in transfer_ids:
            self.get(tid)
        return Follower(self, self.watch(transfer_ids), transfer_ids)


class Follower:
    """A registered watch (:meth:`PullBook.follow`) as an async iterator; :meth:`close` (or the
    last named pull ending) unregisters it."""

    def __init__(
        self, book: PullBook, q: Backlog[PullRecord], transfer_ids: frozenset[str]
    ) -> None:
        self._book = book
        self._q = q
        self._pending = set(transfer_ids)
        self._named = bool(transfer_ids)

    def __aiter__(self) -> Follower:
        return self

    async def __anext__(self) -> PullRecord:
        if self._named and not self._pending:
            self.close()
            raise StopAsyncIteration
        rec = await self._q.get()
        if self._named and rec.state.terminal:
            self._pending.discard(rec.transfer_id)
        return rec

    def close(self) -> None:
        self._book.unwatch(self._q)


@dataclass(frozen=True)
class PullRequest:
    """A scheduler's StartPull, decoded. Block IDs are logical, one array per KV group."""

    transfer_id: str
    request_id: str
    peer_address: str
    remote_ids: tuple[Int64Array, ...]
    local_ids: tuple[Int64Array, ...]
    deadline_s: float
    notify: bool = True
    fingerprint: bytes = b""  # identifies the request for idempotent retries
    received: float = 0.0  # monotonic time its RPC reached the handler (the pull's t0)

    def check(self, max_deadline_s: float) -> None:
        """Refuse a request a caller can fix (:func:`check_target`)."""
        check_target(self.request_id, self.peer_address, self.deadline_s, max_deadline_s)


def check_target(
    request_id: str, peer_address: str, deadline_s: float, max_deadline_s: float
) -> None:
    """Refuse what a caller can fix in a call about a held request (StartPull, DeclinePull):
    an empty or malformed request ID or address, a deadline outside ``(0, max_deadline_s]``."""
    if not request_id:
        raise InvalidRequest(
            "request_id is empty",
            field="request_id",
            fix="pass the request ID the prefill engine held (HoldResponse.request_id)",
        )
    notify.check_request_id(request_id)
    if not peer_address:
        raise InvalidRequest(
            "peer_address is empty", field="peer_address", fix="pass HoldResponse.peer_address"
        )
    if not 0 < deadline_s <= max_deadline_s:
        raise InvalidRequest(
            f"deadline {deadline_s:g}s is outside (0, {max_deadline_s:g}]",
            field="deadline_ms",
            fix=f"ask for at most {int(max_deadline_s * 1000)} ms (the longest"
            " lease an owner grants), or 0 for transfer.default_deadline_ms",
        )


class Stages:
    """Where one pull's time went: named marks on the monotonic clock, in the order they
    happen; each stage's duration is its mark minus the previous one."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._last = t0
        self.items: list[tuple[str, float]] = []

    def mark(self, name: str) -> tuple[tuple[str, float], ...]:
        return self.at(name, time.monotonic())

    def at(self, name: str, t: float) -> tuple[tuple[str, float], ...]:
        if t > 0:
            t = max(t, self._last)
            self.items.append((name, t - self._last))
            self._last = t
        return tuple(self.items)
