"""The owner side of push mode (prefill): WRITE a held request into a reader's blocks.

``transfer.mode = "push"`` turns the data plane around: the decode daemon still plans, confirms
its share of the owner's lease and waits for a terminal status, but instead of READing it asks
this daemon (``Peer.Push``) to WRITE. Before anything is posted, :meth:`Pusher.push` checks, for
the caller's handshake session (never a name in the request):

* the request is held here and the caller's share of its lease is still reading (it confirmed;
  the share is extended to cover the WRITE);
* every owner block ID it names is held under that request (so nothing else is read);
* the byte ranges, which this daemon plans itself from both handshakes' specs with the same
  planner a pull uses (:func:`kvxferd.blocks.plan_pull`, prefix-cache trim included), lie
  inside the caller's registered regions and its own (:func:`kvxferd.transfer.descriptors.
  build_descriptors` bounds-checks both sides), so a hostile caller can make it write only into
  the caller's own registered memory.

Then it posts one NIXL WRITE to the caller's agent with a WRITE_DONE notification carrying the
caller's ticket, answers once the WRITE completed, and ends the caller's share as a READ_DONE
would; a WRITE that fails or outlasts its timeout fails the call (the share then lapses, as after
a failed pull). Cancelling the call cancels the WRITE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.daemon.owner import Owner
from kvxferd.daemon.parts import Parts
from kvxferd.daemon.peers import RemoteDescription
from kvxferd.daemon.sessions import PeerSession
from kvxferd.errors import (
    BlockRangeError,
    IncompatiblePeer,
    InvalidRequest,
    KvxferdError,
    LeaseRefused,
    Mismatch,
)
from kvxferd.logs import kv
from kvxferd.nixl import XferOp
from kvxferd.transfer import TransferStatus, notify
from kvxferd.transfer.descriptors import RegionTable

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PushOrder:
    """A decoded ``PushRequest``: the owner's (``remote_ids``) and the caller's (``local_ids``)
    logical block IDs per group, named from the caller's side as in a pull."""

    request_id: str
    remote_ids: tuple[Int64Array, ...]
    local_ids: tuple[Int64Array, ...]
    ticket: int
    timeout_s: float
    transfer_id: str = ""


@dataclass(frozen=True)
class Pushed:
    """A completed WRITE."""

    nbytes: int
    descriptors: int
    elapsed_s: float


def reversed_plan(plan: TransferPlan) -> TransferPlan:
    """A pull's plan as the owner posts it: its own offsets local, the reader's remote."""
    return TransferPlan(
        ranges=tuple(
            RegionRanges(r.region, r.name, r.remote_offset, r.local_offset, r.length)
            for r in plan.ranges
        ),
        naive_descriptors=plan.naive_descriptors,
    )


def check_inside(plan: TransferPlan, remote: RegionTable) -> None:
    """Every remote range of ``plan`` lies inside ``remote``'s registered regions."""
    for r in plan.ranges:
        if r.num_ranges == 0:
            continue
        if not 0 <= r.region < remote.num_regions:
            raise BlockRangeError(
                f"the push would write region {r.region}; the caller registered"
                f" {remote.num_regions}",
                field="local_block_ids",
                fix="handshake again: the caller's registrations do not match its spec",
            )
        end = r.remote_offset + r.length
        if int(r.remote_offset.min()) < 0 or int(end.max()) > int(remote.length[r.region]):
            raise BlockRangeError(
                f"the push would write outside the caller's registered region {r.name!r}"
                f" (0..{int(remote.length[r.region])} bytes); nothing was written",
                field="local_block_ids",
                fix="send block IDs inside the registered pool, and registrations that cover"
                " the spec's blocks",
            )


class Pusher:
    """Push mode, owner side. ``connect`` loads a reader's NIXL metadata and regions into the
    transfer engine (:meth:`kvxferd.daemon.core.Daemon.connect_remote`)."""

    def __init__(
        self, parts: Parts, owner: Owner, connect: Callable[[RemoteDescription], None]
    ) -> None:
        self.p = parts
        self.owner = owner
        self._connect = connect
        self._loaded: dict[str, tuple[str, str, int]] = {}  # agent -> the incarnation loaded
        self._loading = asyncio.Lock()  # a second load of one agent cancels WRITEs to it

    async def push(self, session: PeerSession, order: PushOrder) -> Pushed:
        """Check everything, then WRITE and wait for the WRITE to complete (see the module)."""
        t0 = time.monotonic()
        self._check_order(order)
        generation = self.p.slot.generation  # the pool the blocks are checked and planned in
        remote = self.owner.described(session)
        held = self.owner.held(order.request_id)  # NotFound / LeaseRefused: not held (any more)
        # The caller's own share must still be reading (PermissionDenied if it never confirmed);
        # it now lasts at least as long as the WRITE may.
        self.p.leases.extend(
            order.request_id, session.reader, self.owner.share_s(order.timeout_s + 1.0)
        )
        self._check_held(order, held.logical_ids)
        own = self.p.info
        plan = plan_pull(
            remote.info.spec,
            own.spec,
            list(order.local_ids),
            list(order.remote_ids),
            prefix_caching=remote.info.prefix_caching,
            local_tp=(remote.info.tp_rank, remote.info.tp_size),
            remote_tp=(own.tp_rank, own.tp_size),
            max_ids=self.p.limits.max_block_ids,
        )
        part = plan.per_rank.get(own.tp_rank) or TransferPlan(ranges=())
        write = reversed_plan(part)
        # The caller's side first, before its metadata is loaded; prepare() checks both again.
        check_inside(write, RegionTable.from_array(remote.regions))
        await self._load(remote)
        if (
            self.p.slot.generation != generation
            or self.p.leases.is_reading(order.request_id, session.reader) is not True
        ):  # the load awaited: our engine re-attached, or the caller's share ended meanwhile
            raise LeaseRefused(
                f"the blocks of {order.request_id!r} were let go while the reader's metadata"
                " loaded (this daemon's engine detached, or the share ended); nothing was written",
                field="request_id",
                fix="re-run the prefill and pull again",
            )
        xid = f"push/{session.token[:8]}/{order.ticket:016x}"
        engine = self.p.engine
        prepared = engine.prepare(xid, remote.agent_name, write, op=XferOp.WRITE)
        note = notify.encode(order.request_id, order.ticket, notify.NotifKind.WRITE_DONE)
        xfer = engine.submit_prepared(prepared, notif=note, timeout_s=order.timeout_s)
        try:
            result = await xfer.wait()
        except asyncio.CancelledError:  # the caller gave up (or the daemon stops)
            await asyncio.wrap_future(engine.cancel(xid))
            raise
        log.info(
            "push finished",
            extra=kv(
                request_id=order.request_id,
                transfer_id=order.transfer_id,
                peer=remote.address or session.address,
                state=result.status.value,
                bytes=result.nbytes,
                descriptors=result.descriptors,
                ms=round(result.elapsed_s * 1e3, 3),
                error=result.reason,
            ),
        )
        if result.status is not TransferStatus.DONE:
            raise result.error or KvxferdError(
                f"the WRITE of {order.request_id!r} ended {result.status.value}: {result.reason}"
            )
        # Written: the caller's share ends as its READ_DONE would end it after a pull.
        self.p.leases.finish(order.request_id, session.reader, done=True)
        return Pushed(result.nbytes, result.descriptors, time.monotonic() - t0)

    def _check_order(self, order: PushOrder) -> None:
        mode = self.p.limits.transfer_mode
        if mode != "push":
            raise IncompatiblePeer(
                [
                    Mismatch(
                        "transfer mode (transfer.mode)",
                        repr(mode),
                        "'push' (the caller asked for a Push)",
                        "set the same transfer.mode on both daemons; this one only answers READs",
                    )
                ]
            )
        if not 0 < order.ticket < 1 << 64:
            raise InvalidRequest(
                "notif_ticket is 0",
                field="notif_ticket",
                fix="send a non-zero ticket to match the WRITE_DONE notification against",
            )
        if not 0 < order.timeout_s <= self.p.limits.max_deadline_s:
            raise InvalidRequest(
                f"write_timeout_ms {order.timeout_s * 1000:g} is outside"
                f" (0, {self.p.limits.max_deadline_s * 1000:g}]",
                field="write_timeout_ms",
                fix="send how long the WRITE may take, shorter than the pull's deadline",
            )

    def _check_held(self, order: PushOrder, held: tuple[Int64Array, ...]) -> None:
        if len(order.remote_ids) != len(held):
            raise InvalidRequest(
                f"{len(order.remote_ids)} remote block-ID lists for {len(held)} KV cache groups",
                field="remote_block_ids.groups",
                fix="pass exactly the remote_block_ids that Hold returned",
            )
        for g, ids in enumerate(order.remote_ids):
            missing = np.setdiff1d(ids, held[g])
            if missing.size:
                raise LeaseRefused(
                    f"remote block IDs {missing[:8].tolist()} of group {g} are not held under"
                    f" request {order.request_id!r}; nothing was written",
                    field=f"remote_block_ids.groups[{g}]",
                    fix="pass exactly the remote_block_ids that Hold returned",
                )

    async def _load(self, remote: RemoteDescription) -> None:
        """Load the caller's NIXL metadata and regions once per incarnation (a pull-mode owner
        never does: only a writer needs them)."""
        async with self._loading:
            if self._loaded.get(remote.agent_name) == remote.key:
                return
            await asyncio.to_thread(self._connect, remote)
            self._loaded[remote.agent_name] = remote.key
