"""The transfer engine: plans in, NIXL transfers out, every transfer to a terminal state.

``submit`` (any thread) validates the plan against both sides' regions, builds the
descriptors vectorised and coalesced (:mod:`kvxferd.transfer.descriptors`), admits the bytes
against the peer's in-flight budget, and queues the post on the NIXL thread. A poller on that
thread checks every in-flight transfer back to back (a 20 us sleep between sweeps, which only
yields the GIL to the event loop; nothing at all when idle) and ends each one:

* ``DONE``: NIXL reports completion (its notification, if any, reaches the owner with it);
* ``FAILED``: NIXL raised (a dead peer raises ``nixlRemoteDisconnectError`` within ~100 ms);
* ``EXPIRED``: still in progress at the deadline (a stopped peer never completes);
* ``CANCELLED``: :meth:`TransferEngine.cancel`, a peer re-handshake or shutdown.

Every path releases the NIXL handle (which also cancels it); a handle NIXL refuses to free is
retried on later polls. Results are delivered through a :class:`concurrent.futures.Future`
per transfer (``await transfer.wait()`` from asyncio); callbacks run on the NIXL thread, so
keep them short. What runs on the NIXL thread (post, poll, end) is
:class:`~kvxferd.transfer.inflight.InFlight`; this module validates and admits.

Back-pressure: each peer has a budget of in-flight bytes. A submit that would exceed it fails
fast with :class:`ResourceExhausted` (the caller or scheduler retries or picks another peer);
nothing queues silently behind a slow peer. A single transfer larger than the whole budget is
admitted when nothing else is in flight to that peer, so large requests are never starved.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.errors import (
    AlreadyExists,
    Cancelled,
    EngineDetached,
    InvalidRequest,
    KvxferdError,
    PeerUnavailable,
    ResourceExhausted,
)
from kvxferd.logs import kv
from kvxferd.nixl import MemType, NixlAgent, XferOp
from kvxferd.transfer.descriptors import Int64Array, RegionTable, build_descriptors
from kvxferd.transfer.inflight import Clock, InFlight, Transfer
from kvxferd.transfer.state import TransferResult, TransferStatus

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    name: str
    regions: RegionTable
    mem: MemType
    inflight_bytes: int = 0
    inflight: int = 0


@dataclass(frozen=True)
class Prepared:
    """Descriptors built for a plan, not yet admitted or posted (:meth:`TransferEngine.prepare`)."""

    transfer_id: str
    peer: str
    op: XferOp
    plan: TransferPlan
    local: Int64Array
    remote: Int64Array
    state: _Peer = field(repr=False)
    table: RegionTable = field(repr=False)
    nbytes: int = 0  # the descriptors' total length


@dataclass(frozen=True)
class EngineOptions:
    max_inflight_bytes_per_peer: int = 8 << 30
    default_timeout_s: float = 30.0
    min_poll_s: float = 20e-6
    max_poll_s: float = 1e-3
    coalesce: bool = True  # False only to measure the one-descriptor-per-range baseline
    # Cut merged ranges above this size; with a multi-threaded UCX backend (num_threads > 1)
    # pieces spread over its threads, while one huge descriptor is copied by one thread.
    max_desc_bytes: int | None = None


class TransferEngine:
    """Moves plans between this agent's regions and its peers'. Starts nothing until start()."""

    def __init__(
        self,
        agent: NixlAgent,
        local_regions: npt.ArrayLike,
        *,
        local_mem: MemType = MemType.DRAM,
        options: EngineOptions | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._agent = agent
        self._local = RegionTable.from_array(local_regions)
        self._local_mem = local_mem
        self._opts = options or EngineOptions()
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[str, Transfer] = {}
        self._flight = InFlight(
            agent,
            mems=self._mems,
            stale=self._stale,
            on_end=self._ended,
            min_poll_s=self._opts.min_poll_s,
            max_poll_s=self._opts.max_poll_s,
            clock=clock,
        )
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._agent.add_poller(self._flight.poll)
        self._started = True

    def close(self) -> None:
        """Cancel everything in flight and stop polling (the agent stays up)."""
        if not self._started:
            return
        self._agent.submit(self._cancel_all, "engine closed").result()
        self._agent.remove_poller(self._flight.poll)
        self._started = False

    def set_local(self, local_regions: npt.ArrayLike | None, mem: MemType, reason: str) -> None:
        """Swap the local regions (an engine attached or detached its pool). Every transfer in
        flight is cancelled first, since its local memory is about to change; ``None`` (no
        pool) makes :meth:`submit` refuse until regions are set again."""
        table = RegionTable.from_array(
            np.zeros((0, 3), dtype=np.int64) if local_regions is None else local_regions
        )
        if self._started:
            self._agent.submit(self._set_local_now, table, mem, reason).result()
        else:
            self._set_local_now(table, mem, reason)

    def _set_local_now(self, table: RegionTable, mem: MemType, reason: str) -> None:
        self._cancel_all(reason)
        with self._lock:
            self._local = table
            self._local_mem = mem

    # -- peers ------------------------------------------------------------------------------

    def connect_peer(
        self, name: str, metadata: bytes, regions: npt.ArrayLike, mem: MemType = MemType.DRAM
    ) -> None:
        """Load a peer's NIXL metadata and regions (from its handshake). A peer already known
        (restarted, re-registered) has its in-flight transfers cancelled and is replaced."""
        table = RegionTable.from_array(regions)
        self._agent.submit(self._connect_now, name, metadata, table, mem).result()

    def _connect_now(self, name: str, metadata: bytes, table: RegionTable, mem: MemType) -> None:
        self._fail_peer_now(
            name,
            Cancelled(f"peer {name} re-handshaked with new metadata", fix="retry the pull"),
            TransferStatus.CANCELLED,
        )
        self._agent.add_remote(name, metadata)
        with self._lock:
            self._peers[name] = _Peer(name, table, mem)
        log.info("peer connected", extra=kv(peer=name, regions=table.num_regions, mem=mem.value))

    def disconnect_peer(self, name: str, reason: str = "peer removed") -> None:
        """Fail the peer's transfers (FAILED, PeerUnavailable) and unload its metadata."""
        self._agent.submit(self._disconnect_now, name, reason).result()

    def _disconnect_now(self, name: str, reason: str) -> None:
        self._fail_peer_now(name, PeerUnavailable(f"peer {name}: {reason}"), TransferStatus.FAILED)
        with self._lock:
            self._peers.pop(name, None)
        if self._agent.has_remote(name):
            self._agent.remove_remote(name)

    def inflight_bytes(self, peer: str) -> int:
        with self._lock:
            p = self._peers.get(peer)
            return p.inflight_bytes if p else 0

    @property
    def unreleased_handles(self) -> int:
        """Handles of ended transfers that NIXL has not freed yet (0 when all is well)."""
        return self._flight.unreleased_handles

    def _mems(self, peer: str) -> tuple[MemType, MemType] | None:
        with self._lock:
            p = self._peers.get(peer)
            return None if p is None else (self._local_mem, p.mem)

    def _stale(self, xfer: Transfer) -> str:
        with self._lock:
            if self._peers.get(xfer.peer) is not xfer._peer_state:
                return f"peer {xfer.peer} was replaced (it handshaked again) before the READ"
            if self._local is not xfer._local_table:
                return "the local KV pool changed (an engine attached or detached) before the READ"
        return ""

    def _ended(self, xfer: Transfer) -> None:
        """A transfer ended (NIXL thread): free its share of the budget of the peer entry it
        was admitted against (a replaced peer's new entry never carried it)."""
        with self._lock:
            self._transfers.pop(xfer.transfer_id, None)
            p = xfer._peer_state
            if isinstance(p, _Peer):
                p.inflight_bytes -= xfer.nbytes
                p.inflight -= 1

    # -- submit -----------------------------------------------------------------------------

    def prepare(
        self, transfer_id: str, peer: str, plan: TransferPlan, *, op: XferOp = XferOp.READ
    ) -> Prepared:
        """Validate ``plan`` against both sides' regions and build its descriptors (vectorised,
        coalesced); nothing is admitted or posted. Cheap to throw away."""
        with self._lock:
            p = self._peers.get(peer)
            local_table = self._local
        if p is None:
            raise PeerUnavailable(
                f"peer {peer!r} is not connected",
                fix="handshake with the peer before pulling from it",
            )
        if local_table.num_regions == 0:
            raise EngineDetached(
                "no local KV pool is registered (the engine detached), so there is nowhere"
                " to read into",
                fix="pull again once the engine has re-attached",
            )
        local, remote = build_descriptors(
            plan,
            local_table,
            p.regions,
            merge=self._opts.coalesce,
            max_desc_bytes=self._opts.max_desc_bytes,
        )
        nbytes = int(local[:, 1].sum())
        return Prepared(transfer_id, peer, op, plan, local, remote, p, local_table, nbytes)

    def is_current(self, prep: Prepared) -> bool:
        """Whether ``prep`` was built against the current peer and local regions (else
        :meth:`submit_prepared` prepares it again first)."""
        with self._lock:
            return self._peers.get(prep.peer) is prep.state and self._local is prep.table

    def submit(
        self,
        transfer_id: str,
        peer: str,
        plan: TransferPlan,
        *,
        notif: bytes = b"",
        op: XferOp = XferOp.READ,
        timeout_s: float | None = None,
    ) -> Transfer:
        """Start moving ``plan`` (READ from ``peer`` by default); never blocks on I/O."""
        return self.submit_prepared(
            self.prepare(transfer_id, peer, plan, op=op), notif=notif, timeout_s=timeout_s
        )

    def submit_prepared(
        self,
        prep: Prepared,
        *,
        notif: bytes = b"",
        timeout_s: float | None = None,
        transfer_id: str | None = None,
    ) -> Transfer:
        """Admit and post what :meth:`prepare` built, as ``transfer_id`` if given (one prepared
        plan may be posted many times, each under its own ID, never two at once under one).
        If the peer or the local pool changed since, it is prepared again against the current
        ones."""
        timeout = self._opts.default_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise InvalidRequest(f"timeout must be positive, got {timeout}", field="timeout_s")
        if not self.is_current(prep):
            prep = self.prepare(prep.transfer_id, prep.peer, prep.plan, op=prep.op)
        peer, plan, p = prep.peer, prep.plan, prep.state
        transfer_id = prep.transfer_id if transfer_id is None else transfer_id
        local, remote = prep.local, prep.remote
        now = self._clock()
        xfer = Transfer(
            transfer_id,
            peer,
            prep.op,
            plan,
            prep.nbytes,
            int(local.shape[0]),
            now,
            now + timeout,
            _local=local,
            _remote=remote,
            _notif=notif,
            _peer_state=p,
            _local_table=prep.table,
        )
        with self._lock:
            if transfer_id in self._transfers:
                raise AlreadyExists(
                    f"transfer {transfer_id!r} is already in flight", field="transfer_id"
                )
            if self._peers.get(peer) is not p:
                raise PeerUnavailable(
                    f"peer {peer!r} changed while submitting", fix="retry the pull"
                )
            budget = self._opts.max_inflight_bytes_per_peer
            if p.inflight and p.inflight_bytes + xfer.nbytes > budget:
                raise ResourceExhausted(
                    f"peer {peer}: {p.inflight_bytes} bytes in flight + {xfer.nbytes} "
                    f"exceeds the budget of {budget}",
                    fix="retry after in-flight transfers finish, or raise "
                    "max_inflight_bytes_per_peer",
                )
            p.inflight_bytes += xfer.nbytes
            p.inflight += 1
            self._transfers[transfer_id] = xfer
        if log.isEnabledFor(logging.DEBUG):  # kv() is built only when it is logged
            log.debug(
                "transfer submitted",
                extra=kv(
                    transfer_id=transfer_id,
                    peer=peer,
                    op=prep.op.value,
                    bytes=xfer.nbytes,
                    descriptors=xfer.descriptors,
                    naive=plan.naive_descriptors,
                    timeout_s=round(timeout, 3),
                ),
            )
        fut = self._agent.submit(self._flight.post, xfer)
        fut.add_done_callback(lambda f: self._flight.post_failed(xfer, f))
        return xfer

    async def pull(
        self,
        transfer_id: str,
        peer: str,
        plan: TransferPlan,
        *,
        notif: bytes = b"",
        timeout_s: float | None = None,
    ) -> TransferResult:
        return await self.submit(transfer_id, peer, plan, notif=notif, timeout_s=timeout_s).wait()

    def notify(self, peer: str, msg: bytes) -> Future[None]:
        """Send ``msg`` to ``peer`` as a NIXL notification, on the NIXL thread."""
        return self._agent.submit(self._agent.send_notif, peer, msg)

    def get(self, transfer_id: str) -> Transfer | None:
        with self._lock:
            return self._transfers.get(transfer_id)

    def cancel(self, transfer_id: str) -> Future[bool]:
        """Cancel a transfer (release its handle); the future says whether it was live."""
        return self._agent.submit(self._cancel_now, transfer_id)

    # -- on the NIXL thread -----------------------------------------------------------------

    def _cancel_now(self, transfer_id: str) -> bool:
        with self._lock:
            xfer = self._transfers.get(transfer_id)
        if xfer is None or xfer.status.terminal:
            return False
        self._flight.finish(xfer, TransferStatus.CANCELLED, Cancelled("cancelled by caller"))
        return True

    def _cancel_all(self, reason: str) -> None:
        with self._lock:
            live = list(self._transfers.values())
        for xfer in live:
            if not xfer.status.terminal:
                self._flight.finish(xfer, TransferStatus.CANCELLED, Cancelled(reason))

    def _fail_peer_now(self, name: str, err: KvxferdError, status: TransferStatus) -> None:
        with self._lock:
            live = [x for x in self._transfers.values() if x.peer == name]
        for xfer in live:
            if not xfer.status.terminal:
                self._flight.finish(xfer, status, err)


__all__ = ["EngineOptions", "Prepared", "Transfer", "TransferEngine"]
