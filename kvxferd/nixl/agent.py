"""``NixlAgent``: one NIXL agent, every call on one dedicated thread, typed in and out.

Blocking methods (``register``, ``post``, ...) may be called from any thread. Code that must
not block (asyncio) uses :meth:`NixlAgent.submit` or ``register_async``, which return a
:class:`concurrent.futures.Future` to await with ``asyncio.wrap_future``. Pollers registered
with :meth:`NixlAgent.add_poller` run on the NIXL thread and may call the blocking methods
directly (they run inline there). NIXL behaviour this module is written against (polling,
restarted peers, the progress thread's delay): docs/nixl.md.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvxferd.errors import InvalidRequest, PeerUnavailable, TransportError
from kvxferd.logs import kv
from kvxferd.nixl.create import AgentOptions, create_binding_agent
from kvxferd.nixl.errors import map_nixl_error
from kvxferd.nixl.types import (
    Int64Array,
    MemType,
    ProgressMode,
    XferOp,
    XferState,
    XferTelemetry,
    check_descs,
)
from kvxferd.nixl.worker import NixlThread, Poller
from kvxferd.nixl.xfer import PostArgs, XferHandle, post_xfer, read_telemetry, release_raw

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Registration:
    """Memory registered with the agent: one NIXL registration per region row. Compared by
    identity: two registrations of the same rows are still two registrations."""

    regions: Int64Array
    mem_type: MemType
    _dlist: Any = field(repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.regions[:, 1].sum())


class NixlAgent:
    """One NIXL agent named ``name``; constructing it starts no thread and no I/O."""

    def __init__(
        self,
        name: str,
        *,
        cuda_device: int | None = None,
        options: AgentOptions | None = None,
    ) -> None:
        if not name:
            raise InvalidRequest("agent name must not be empty", field="name")
        self.name = name
        self.cuda_device = cuda_device
        self.options = options or AgentOptions()
        self._thread = NixlThread(
            f"nixl-{name}", cuda_device=cuda_device, idle_wait_s=self.options.idle_poll_s
        )
        self._agent: Any = None
        self._remotes: set[str] = set()
        self._registrations: list[Registration] = []
        self._stashed: dict[str, list[bytes]] = {}

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the NIXL thread and create the agent on it."""
        self._thread.start()
        try:
            self._thread.call(self._create)
        except BaseException:
            self._thread.stop()
            raise

    def _create(self) -> None:
        opts = self.options
        self._agent = create_binding_agent(self.name, opts)
        if opts.progress is ProgressMode.POLL:
            # No progress thread: the NIXL thread must progress the worker even when no engine
            # or pump polls, or a peer reading from us would hang.
            self._thread.add_poller(self._progress)
        log.info(
            "NIXL agent started",
            extra=kv(
                agent=self.name,
                progress=opts.progress.value,
                delay_us=opts.progress_delay_us,
                device=self.cuda_device,
            ),
        )

    def close(self) -> None:
        """Deregister everything, drop the agent on its thread, stop the thread."""
        if not self._thread.running:
            return
        try:
            self._thread.call(self._destroy)
        finally:
            self._thread.stop()

    def _destroy(self) -> None:
        for reg in list(self._registrations):
            try:
                self._deregister(reg)
            except Exception:
                log.exception("NIXL deregistration failed", extra=kv(agent=self.name))
        self._agent = None  # the binding's destructor runs here, on the NIXL thread

    def __enter__(self) -> NixlAgent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def started(self) -> bool:
        return self._agent is not None

    # -- thread access ----------------------------------------------------------------------

    def add_poller(self, poller: Poller) -> None:
        self._thread.add_poller(poller)

    def remove_poller(self, poller: Poller) -> None:
        self._thread.remove_poller(poller)

    def wake(self) -> None:
        """Run the NIXL thread's pollers now instead of at the end of its wait (any thread)."""
        self._thread.wake()

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        """Run an arbitrary callable on the NIXL thread (for callers that batch several calls)."""
        return self._thread.submit(fn, *args)

    def _live(self) -> Any:
        if self._agent is None:
            raise TransportError(
                f"NIXL agent {self.name} is not started", fix="call NixlAgent.start() first"
            )
        return self._agent

    # -- registration -----------------------------------------------------------------------

    def register(self, regions: Int64Array, mem_type: MemType) -> Registration:
        """Register N regions (an ``N x 3`` int64 ``(addr, len, dev)`` array), one NIXL
        registration entry per region: never per block."""
        return self._thread.call(self._register, regions, mem_type)

    def register_async(self, regions: Int64Array, mem_type: MemType) -> Future[Registration]:
        return self._thread.submit(self._register, regions, mem_type)

    def _register(self, regions: Int64Array, mem_type: MemType) -> Registration:
        arr = check_descs(regions, "regions")
        if arr.shape[0] == 0:
            raise InvalidRequest("nothing to register: zero regions", field="regions")
        agent = self._live()
        try:
            dlist = agent.register_memory(arr, mem_type.value)
        except Exception as exc:
            raise map_nixl_error(exc, op="register memory") from exc
        if dlist is None:
            raise InvalidRequest(
                f"NIXL refused to register {arr.shape[0]} {mem_type.value} region(s)",
                field="regions",
                fix="pass an N x 3 int64 array of (addr, len, dev) with the right memory type",
            )
        reg = Registration(arr.copy(), mem_type, dlist)
        self._registrations.append(reg)
        log.info(
            "memory registered with NIXL",
            extra=kv(
                agent=self.name, regions=int(arr.shape[0]), bytes=reg.nbytes, mem=mem_type.value
            ),
        )
        return reg

    def deregister(self, reg: Registration) -> None:
        self._thread.call(self._deregister, reg)

    def _deregister(self, reg: Registration) -> None:
        agent = self._live()
        if reg not in self._registrations:
            raise InvalidRequest("registration is unknown or already deregistered")
        try:
            agent.deregister_memory(reg._dlist)
        except Exception as exc:
            raise map_nixl_error(exc, op="deregister memory") from exc
        self._registrations.remove(reg)

    # -- metadata and peers -----------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (send it to peers in the handshake)."""
        return self._thread.call(self._metadata)

    def _metadata(self) -> bytes:
        try:
            md = self._live().get_agent_metadata()
        except Exception as exc:
            raise map_nixl_error(exc, op="get agent metadata") from exc
        if not isinstance(md, bytes | bytearray) or not md:
            raise TransportError("NIXL returned no agent metadata")
        return bytes(md)

    def add_remote(self, name: str, metadata: bytes) -> None:
        """Load peer ``name``'s metadata; a known name (restarted peer) is removed first."""
        self._thread.call(self._add_remote, name, metadata)

    def _add_remote(self, name: str, metadata: bytes) -> None:
        agent = self._live()
        if name in self._remotes:
            self._remove_remote(name)
        try:
            loaded = agent.add_remote_agent(metadata)
        except Exception as exc:
            raise map_nixl_error(exc, op="add remote agent", peer=name) from exc
        try:
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        except UnicodeDecodeError:
            loaded_name = repr(loaded)
        if loaded_name != name:
            try:
                agent.remove_remote_agent(loaded)
            except Exception:
                log.exception(
                    "removing a mismatched remote agent failed", extra=kv(agent=self.name)
                )
            raise PeerUnavailable(
                f"metadata names agent {loaded_name!r}, expected {name!r}",
                fix="the peer's handshake and NIXL metadata disagree: restart the peer",
            )
        self._remotes.add(name)
        log.info(
            "NIXL remote agent loaded",
            extra=kv(agent=self.name, peer=name, md_bytes=len(metadata)),
        )

    def remove_remote(self, name: str) -> None:
        self._thread.call(self._remove_remote, name)

    def _remove_remote(self, name: str) -> None:
        agent = self._live()
        self._remotes.discard(name)
        try:
            agent.remove_remote_agent(name)
        except Exception as exc:
            raise map_nixl_error(exc, op="remove remote agent", peer=name) from exc
        log.info("NIXL remote agent removed", extra=kv(agent=self.name, peer=name))

    def has_remote(self, name: str) -> bool:
        return name in self._remotes

    # -- transfers --------------------------------------------------------------------------

    def post(
        self,
        op: XferOp,
        local: Int64Array,
        remote: Int64Array,
        *,
        peer: str,
        local_mem: MemType = MemType.DRAM,
        remote_mem: MemType = MemType.DRAM,
        notif: bytes = b"",
    ) -> XferHandle:
        """Create and post one transfer of paired descriptors (built per request)."""
        return self._thread.call(
            self._post, PostArgs(op, local, remote, peer, (local_mem, remote_mem), notif)
        )

    def _post(self, req: PostArgs) -> XferHandle:
        return post_xfer(self._live(), req, agent_name=self.name, remotes=self._remotes)

    def poll(self, handle: XferHandle) -> XferState:
        """Current state of ``handle``; failures raise the mapped kvxferd error."""
        return self._thread.call(self._poll, handle)

    def _poll(self, handle: XferHandle) -> XferState:
        if handle.released:
            raise InvalidRequest("transfer handle already released")
        try:
            return XferState.from_nixl(self._live().check_xfer_state(handle._handle))
        except Exception as exc:
            raise map_nixl_error(exc, op=f"poll {handle.op.value}", peer=handle.peer) from exc

    def telemetry(self, handle: XferHandle) -> XferTelemetry | None:
        """NIXL's figures for a completed transfer, or None without ``capture_telemetry``."""
        return self._thread.call(self._telemetry, handle)

    def _telemetry(self, handle: XferHandle) -> XferTelemetry | None:
        if handle.released or not self.options.capture_telemetry:
            return None
        return read_telemetry(self._live(), handle)

    def release(self, handle: XferHandle) -> bool:
        """Release (and thereby cancel) ``handle``; True when NIXL freed it."""
        return self._thread.call(self._release, handle)

    def _release(self, handle: XferHandle) -> bool:
        if handle.released:
            return True
        handle.released = self._release_raw(handle._handle, handle.peer)
        return handle.released

    def _release_raw(self, raw: Any, peer: str) -> bool:
        return release_raw(self._live(), raw, peer, agent_name=self.name)

    # -- notifications ----------------------------------------------------------------------

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, keyed by sender agent name (always str)."""
        return self._thread.call(self._get_notifs)

    def _get_notifs(self) -> dict[str, list[bytes]]:
        self._drain_notifs()
        out, self._stashed = self._stashed, {}
        return out

    def _drain_notifs(self) -> None:
        try:
            raw = self._live().get_new_notifs()
        except Exception as exc:
            raise map_nixl_error(exc, op="get notifications") from exc
        for key, msgs in raw.items():
            name = key.decode() if isinstance(key, bytes | bytearray) else str(key)
            self._stashed.setdefault(name, []).extend(bytes(m) for m in msgs)

    def _progress(self) -> float | None:
        """POLL mode: progress the UCX worker (getting notifications does) and keep them."""
        if self._agent is not None:
            self._drain_notifs()
        return None

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._thread.call(self._send_notif, peer, msg)

    def _send_notif(self, peer: str, msg: bytes) -> None:
        if peer not in self._remotes:
            raise PeerUnavailable(
                f"peer {peer!r} is not loaded on agent {self.name}",
                fix="handshake with the peer before notifying it",
            )
        try:
            self._live().send_notif(peer, msg)
        except Exception as exc:
            raise map_nixl_error(exc, op="send notification", peer=peer) from exc


__all__ = ["AgentOptions", "NixlAgent", "Registration", "XferHandle"]
