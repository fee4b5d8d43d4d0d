"""Wiring: build every part from one Config, serve until SIGTERM/SIGINT, drain, stop.

This is the one place where parts are constructed and started. Order on start: resolve the
token and TLS files, bind every listener (gRPC TCP port for Peer + Scheduler + health +
reflection, the Engine Unix socket, HTTP metrics) so that a port in use or a bad path is a
one-line :class:`~kvxferd.errors.ConfigError` before any memory is allocated or registered;
then pool, NIXL agent + registration, transfer engine, lease table + notification pump,
daemon; then start serving. A failure part-way undoes what was built, in reverse.
On stop: health NOT_SERVING, drain pulls up to ``server.drain_timeout_s``, stop servers,
stop engine and pump, deregister, close the agent.

Every gRPC server gets :class:`DecodeGuard`, so a request body that is not the method's
protobuf message is INVALID_ARGUMENT (grpc's own answer would be UNKNOWN).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import inspect
import json
import logging
import os
import signal
import socket
import stat
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvxferd.config import DOCS, Config, is_loopback, split_hostport
from kvxferd.daemon.attach import Attacher
from kvxferd.daemon.core import Daemon, DaemonLimits
from kvxferd.daemon.peers import PeerDirectory, PeerLink, RemoteDescription
from kvxferd.daemon.slot import PoolSlot
from kvxferd.errors import ConfigError
from kvxferd.ipc.host import host_id, prepare_ucx_env
from kvxferd.ipc.publish import Publisher
from kvxferd.ipc.transport import TransportReport, probe_peer
from kvxferd.kernels import active_backend
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.layout.tomlspec import load_spec
from kvxferd.logs import kv
from kvxferd.metrics import (
    ACTIVE_STATES,
    LiveState,
    Metrics,
    PeerRpcMetricsInterceptor,
    RpcMetricsInterceptor,
)
from kvxferd.netpolicy import PeerAllowList
from kvxferd.nixl import AgentOptions, MemType, NixlAgent
from kvxferd.peers import PeerInfo
from kvxferd.pool import KVPool
from kvxferd.service.auth import (
    TokenInterceptor,
    call_metadata,
    channel_credentials,
    server_credentials,
)
from kvxferd.service.servicers import EngineService, PeerService, SchedulerService
from kvxferd.staging.ring import StagingRing
from kvxferd.staging.setup import IpcSide, StagingFactory
from kvxferd.staging.stats import Occupancy
from kvxferd.staging.strategy import CostModel
from kvxferd.transfer import EngineOptions, LeaseTable, NotificationPump, TransferEngine
from kvxferd.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.peer_client import GrpcTransport

log = logging.getLogger(__name__)

# Requests carry up to transfer.max_block_ids IDs per group (about 10 bytes each as varints).
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)
# Servers only: without this, gRPC sets SO_REUSEPORT and a second daemon started on the same
# port binds it too and silently takes half of the first one's connections.
SERVER_OPTIONS = (*GRPC_OPTIONS, ("grpc.so_reuseport", 0))
ENGINE_SOCKET_MODE = 0o660
"""The Engine socket's mode, whatever the umask: owner and group (the engine's user joins the
daemon's group); connecting needs write permission, so others cannot. The socket's directory
can restrict it further."""

SERVICE_NAMES = (
    peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name,
    scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
    engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name,
)
TCP_SERVICES = SERVICE_NAMES[:2]
"""What the gRPC TCP port serves (with health and reflection); the Engine service is on the
Unix socket only (with reflection), and each listener's reflection lists only its own."""
PEER_SERVICE = SERVICE_NAMES[0]
"""The health service name readiness probes ask: NOT_SERVING while no pool is registered
(attached mode before the engine attached), SERVING otherwise; "" (overall) is liveness."""


def _known_methods() -> frozenset[str]:
    """Every method a kvxferd listener serves, as ``/service/method`` (metric labels)."""
    from grpc_reflection.v1alpha import reflection_pb2

    files = (peer_pb2, scheduler_pb2, engine_pb2, health_pb2, reflection_pb2)
    return frozenset(
        f"/{svc.full_name}/{m.name}"
        for f in files
        for svc in f.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    )


class _Undecodable:
    """What a guarded deserializer returns for a body that is not the expected message."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _guarded_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    owner = getattr(deserialize, "__self__", None)  # generated code passes Message.FromString
    name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "") or "protobuf"

    def guarded(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            return _Undecodable(
                f"request body is not a valid {name} message ({exc}); send the serialized"
                f" {name} that the method's proto declares (proto/kvxferd/v1)"
            )

    return guarded


async def _refuse_undecodable(request: Any, context: aio.ServicerContext[Any, Any]) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _checked_stream(
    requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    async for request in requests:
        await _refuse_undecodable(request, context)
        yield request


def _guard_handler(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with a deserializer that never raises and a behaviour that aborts with
    INVALID_ARGUMENT on an undecodable body; unchanged when its behaviour is not async."""
    behavior: Callable[..., Any] | None = (
        handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary
    )
    if (
        behavior is None
        or handler.request_deserializer is None
        or not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior))
    ):
        return handler
    deserializer = _guarded_deserializer(handler.request_deserializer)
    streaming_in = handler.request_streaming
    wrapped: Callable[..., Any]
    if inspect.isasyncgenfunction(behavior):

        async def generator(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            if streaming_in:
                request = _checked_stream(request, context)
            else:
                await _refuse_undecodable(request, context)
            async for response in behavior(request, context):
                yield response

        wrapped = generator
    else:

        async def coroutine(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            if streaming_in:
                request = _checked_stream(request, context)
            else:
                await _refuse_undecodable(request, context)
            return await behavior(request, context)

        wrapped = coroutine
    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(
        wrapped,
        request_deserializer=deserializer,
        response_serializer=handler.response_serializer,
    )


class DecodeGuard(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Undecodable request bodies get INVALID_ARGUMENT naming the expected message type.

    gRPC answers UNKNOWN ("Unexpected error") when a deserializer raises; this interceptor
    wraps every method's deserializer and behaviour instead (the wrapped handler is built once
    per method). It must come first, so that it wraps what later interceptors return; calls
    the token interceptor refuses never parse their body."""

    def __init__(self) -> None:
        self._cache: dict[
            str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]
        ] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method: str = details.method
        cached = self._cache.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = _guard_handler(handler)
        if len(self._cache) < 1024:  # methods are registered ones: a few dozen
            self._cache[method] = (handler, guarded)
        return guarded


def pool_spec(cfg: Config) -> KVCacheSpec:
    return load_spec(cfg.pool.spec_file) if cfg.pool.spec_file else preset(cfg.pool.preset)


@dataclass
class Running:
    """A started daemon: its parts and bound addresses (tests use this in-process)."""

    cfg: Config
    daemon: Daemon
    agent: NixlAgent
    engine: TransferEngine
    pump: NotificationPump
    server: aio.Server
    engine_server: aio.Server | None
    health: health_aio.HealthServicer
    peers: PeerDirectory
    grpc_address: str
    engine_socket: str
    attacher: Attacher | None
    metrics_address: str
    http: ThreadingHTTPServer | None
    registry: CollectorRegistry
    metrics_task: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        if self.metrics_task is not None:
            self.metrics_task.cancel()
        await self.health.enter_graceful_shutdown()
        cancelled = await self.daemon.reader.drain(self.cfg.server.drain_timeout_s)
        await self.server.stop(grace=1.0)
        if self.engine_server is not None:
            await self.engine_server.stop(grace=1.0)
        if self.attacher is not None:
            await self.attacher.close()
        await self.daemon.close()
        await self.peers.close()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.pump.stop()
        self.engine.close()
        self.agent.close()
        log.info("stopped", extra=kv(cancelled_pulls=cancelled))


def _agent_name(cfg: Config) -> str:
    return cfg.nixl.agent_name or f"kvxferd-{socket.gethostname()}-{os.getpid()}"


async def start(cfg: Config, *, fill_seed: int | None = None) -> Running:
    """Bind, build, register and start everything; returns once every port serves.

    Listeners are bound before any memory is allocated or registered: a port in use, a bad
    socket path or an unreadable credential file is a ConfigError naming the key, with nothing
    to undo. A later failure closes what was built, in reverse order, and re-raises."""
    token = cfg.resolved_token()  # an empty token file is refused here, never "no auth"
    allow = PeerAllowList.parse(cfg.peers.allow)
    ccreds = channel_credentials(cfg.auth)
    async with contextlib.AsyncExitStack() as undo:
        listeners = await _bind(cfg, token)
        undo.push_async_callback(listeners.close)
        running = await _build(
            cfg,
            token=token,
            allow=allow,
            ccreds=ccreds,
            listeners=listeners,
            undo=undo,
            fill_seed=fill_seed,
        )
        undo.pop_all()
    return running


@dataclass
class Listeners:
    """Every bound listener, not yet serving."""

    server: aio.Server
    host: str
    port: int
    engine_server: aio.Server | None
    engine_socket: str
    socket_ino: int
    http: _MetricsServer | None
    metrics: Metrics | None = None

    async def close(self) -> None:
        """Undo :func:`_bind` when start-up fails: close servers, remove our Engine socket."""
        await self.server.stop(None)
        if self.engine_server is not None:
            await self.engine_server.stop(None)
        if self.http is not None:
            self.http.server_close()
        if self.socket_ino:
            with contextlib.suppress(OSError):
                if os.lstat(self.engine_socket).st_ino == self.socket_ino:
                    os.unlink(self.engine_socket)


async def _bind(cfg: Config, token: str) -> Listeners:
    # Built here so the per-RPC interceptor (first: it also counts refused calls) can count.
    metrics = Metrics.create(CollectorRegistry())
    interceptors: list[aio.ServerInterceptor] = [  # type: ignore[type-arg]
        RpcMetricsInterceptor(metrics, _known_methods()),
        DecodeGuard(),
    ]
    if token:
        interceptors.append(TokenInterceptor(token))
    creds = server_credentials(cfg.auth)  # reads the TLS files: errors name the key
    host, port = split_hostport(cfg.server.listen, "server.listen")
    server = aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    bound = _bind_grpc(
        server, host=host, port=port, creds=creds, key="server.listen", listen=cfg.server.listen
    )
    listeners = Listeners(server, host, bound, None, cfg.server.engine_socket, 0, None, metrics)
    try:
        if cfg.server.engine_socket:
            listeners.engine_server = aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
            listeners.socket_ino = _bind_engine_socket(
                listeners.engine_server, cfg.server.engine_socket
            )
        if cfg.server.metrics_listen:
            listeners.http = _bind_http(cfg.server.metrics_listen)
    except BaseException:
        await listeners.close()
        raise
    return listeners


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _in_use(listen: str, port: int, key: str) -> ConfigError:
    return ConfigError(
        f"cannot listen on {listen}: port {port} is already in use (another kvxferd?)",
        field=key,
        fix=f"stop the process holding it (`ss -ltnp 'sport = :{port}'` shows it) or set {key}"
        f" to a free port ({DOCS})",
    )


def _probe_tcp(host: str, port: int, key: str, listen: str) -> None:
    """Fail with a clear error if ``host:port`` cannot be bound (gRPC would only log a C-core
    line and raise RuntimeError). Port 0 always binds."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"cannot listen on {listen}: host {host!r} does not resolve ({exc.strerror})",
            field=key,
            fix=f"use an IP address of this machine, e.g. 127.0.0.1 or 0.0.0.0 ({DOCS})",
        ) from exc
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise _in_use(listen, port, key) from exc
                if exc.errno == errno.EACCES:
                    raise ConfigError(
                        f"cannot listen on {listen}: permission denied for port {port}",
                        field=key,
                        fix=f"use a port above 1023, or grant CAP_NET_BIND_SERVICE ({DOCS})",
                    ) from exc
                # EADDRNOTAVAIL and the like: gRPC binds what it can and reports the rest.


def _bind_grpc(
    server: aio.Server,
    *,
    host: str,
    port: int,
    creds: grpc.ServerCredentials | None,
    key: str,
    listen: str,
) -> int:
    _probe_tcp(host, port, key, listen)
    bind = _hostport(host, port)
    try:
        bound = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
    except RuntimeError as exc:  # gRPC: "Failed to bind to address ..."
        bound = 0
        cause: BaseException | None = exc
    else:
        cause = None
    if bound == 0:
        raise ConfigError(
            f"cannot listen on {listen}: gRPC could not bind {bind} (in use, or not an address"
            " of this machine)",
            field=key,
            fix=f"pick a free port on a local address ({DOCS})",
        ) from cause
    return bound


def _bind_engine_socket(server: aio.Server, path: str) -> int:
    """Bind the Engine service on ``path`` with mode 0660; return the socket's inode.

    The socket is created under a umask that keeps others out (no window where it is wider),
    then set to exactly :data:`ENGINE_SOCKET_MODE`.

    Never removes anything but a stale socket: a non-socket at ``path`` is refused, a socket
    someone listens on is refused, a socket nobody listens on is removed."""
    key = "server.engine_socket"
    _clear_stale_socket(path, key)
    old = os.umask(0o777)
    try:
        os.umask(old | (0o777 & ~ENGINE_SOCKET_MODE))
        try:
            bound = server.add_insecure_port(f"unix:{path}")
        except RuntimeError:
            bound = 0
    finally:
        os.umask(old)
    if bound == 0:
        raise ConfigError(
            f"cannot create the Engine socket {path}",
            field=key,
            fix=f"make sure its directory exists and is writable by this user ({DOCS})",
        )
    try:
        os.chmod(path, ENGINE_SOCKET_MODE)
        return os.lstat(path).st_ino
    except OSError as exc:
        raise ConfigError(
            f"cannot restrict the Engine socket {path} to owner and group: {exc.strerror}",
            field=key,
            fix=f"put the socket in a directory this user owns ({DOCS})",
        ) from exc


def _clear_stale_socket(path: str, key: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(
            f"cannot inspect {path}: {exc.strerror}",
            field=key,
            fix=f"check the directory's permissions or choose another path ({DOCS})",
        ) from exc
    if not stat.S_ISSOCK(st.st_mode):
        what = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "a regular file"
            if stat.S_ISREG(st.st_mode)
            else "not a socket"
        )
        raise ConfigError(
            f"{path} exists and is {what}, not a socket; kvxferd will not remove it",
            field=key,
            fix=f"move or delete it yourself if it is not needed, or choose another path ({DOCS})",
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(
                f"cannot remove the stale socket {path}: {exc.strerror}",
                field=key,
                fix=f"remove it yourself, or choose another path ({DOCS})",
            ) from exc
        log.info("removed a stale engine socket", extra=kv(path=path))
        return
    except FileNotFoundError:
        return  # removed meanwhile
    except OSError as exc:  # no permission to connect, or a listener with a full backlog
        raise ConfigError(
            f"cannot tell whether another process serves {path} ({exc}); not replacing it",
            field=key,
            fix=f"stop the other daemon or remove the socket yourself, or choose another path"
            f" ({DOCS})",
        ) from exc
    finally:
        probe.close()
    raise ConfigError(
        f"another process (another kvxferd daemon?) listens on {path}",
        field=key,
        fix=f"stop it, or give this daemon its own server.engine_socket ({DOCS})",
    )


class _MetricsServer(ThreadingHTTPServer):
    """/metrics and /healthz; bound at start-up, serving once the daemon exists."""

    registry: CollectorRegistry | None = None
    daemon: Daemon | None = None


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


def _bind_http(listen: str) -> _MetricsServer:
    key = "server.metrics_listen"
    host, port = split_hostport(listen, key)
    cls = _MetricsServer6 if ":" in host else _MetricsServer
    try:
        return cls((host, port), _MetricsHandler)
    except socket.gaierror as exc:
        raise ConfigError(
            f"cannot listen on {listen}: host {host!r} does not resolve ({exc.strerror})",
            field=key,
            fix=f"use an IP address of this machine, e.g. 127.0.0.1 ({DOCS})",
        ) from exc
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise _in_use(listen, port, key) from exc
        raise ConfigError(
            f"cannot listen on {listen}: {exc.strerror or exc}",
            field=key,
            fix=f"use a free port on an address of this machine ({DOCS})",
        ) from exc


async def _build(
    cfg: Config,
    *,
    token: str,
    allow: PeerAllowList,
    ccreds: grpc.ChannelCredentials | None,
    listeners: Listeners,
    undo: contextlib.AsyncExitStack,
    fill_seed: int | None,
) -> Running:
    metrics = listeners.metrics or Metrics.create(CollectorRegistry())
    registry = metrics.registry
    attached = cfg.pool.mode == "attached"
    pool = (
        None
        if attached
        else await asyncio.to_thread(KVPool.allocate, pool_spec(cfg), cfg.pool.device)
    )
    if pool is not None and fill_seed is not None:
        for g in range(len(pool.spec.groups)):
            await asyncio.to_thread(
                pool.fill_pattern, g, range(pool.spec.num_kernel_blocks(g)), fill_seed
            )
    cuda = None
    if cfg.pool.device.startswith("cuda"):
        cuda = int(cfg.pool.device.partition(":")[2] or 0)
        # Before NIXL starts (UCX reads its environment then): cuda_ipc GET zero-copy on a GPU
        # without NVLink (docs/nixl.md §7). Then the CUDA kernels, built once here and never on
        # a pull's path (a first build takes tens of seconds).
        prepare_ucx_env(cfg.pool.device)
        await asyncio.to_thread(active_backend)
    agent = NixlAgent(
        _agent_name(cfg),
        cuda_device=cuda,
        options=AgentOptions(
            progress_delay_us=cfg.nixl.progress_delay_us, num_threads=cfg.nixl.num_threads
        ),
    )
    agent.start()
    undo.callback(agent.close)
    mem = MemType.DRAM
    if cfg.pool.device.startswith("cuda"):
        mem = MemType.VRAM
    rows = np.zeros((0, 3), dtype=np.int64)
    if pool is not None:
        mem = MemType.VRAM if pool.spec.regions[0].memory is MemoryType.VRAM else MemType.DRAM
        rows = pool.region_rows()
        await asyncio.to_thread(agent.register, rows, mem)
    ring, ring_row = None, np.zeros((0, 3), dtype=np.int64)
    if cfg.transfer.staging_chunks:
        # One staging ring, registered once for the daemon's life (attached pools come and
        # go); it is always the engine's last local region, after the pool's regions.
        t = cfg.transfer
        ring = await asyncio.to_thread(
            StagingRing.allocate, t.staging_chunk_bytes, t.staging_chunks, cfg.pool.device
        )
        ring_row = np.array([ring.info.row()], dtype=np.int64)
        await asyncio.to_thread(agent.register, ring_row, mem)
    engine_rows = np.vstack([rows, ring_row])
    metrics.registered_bytes.set(int(rows[:, 1].sum()))  # the KV pool only
    metrics.staging_ring_bytes.set(int(ring_row[:, 1].sum()))
    engine = TransferEngine(
        agent,
        engine_rows,
        local_mem=mem,
        options=EngineOptions(
            max_inflight_bytes_per_peer=cfg.transfer.max_inflight_bytes_per_peer,
            default_timeout_s=cfg.transfer.default_deadline_ms / 1000,
        ),
    )
    engine.start()
    undo.callback(engine.close)
    leases = LeaseTable(max_ttl_s=max(600.0, cfg.transfer.lease_ttl_ms / 1000))
    pump = NotificationPump(
        agent, leases, on_result=lambda result: metrics.notifications.labels(result).inc()
    )
    pump.start()
    undo.callback(pump.stop)

    server = listeners.server
    host, bound = listeners.host, listeners.port
    address = cfg.server.advertise or _hostport(host, bound)
    metadata = agent.metadata()
    daemon = Daemon(
        pool=PoolSlot.detached(metadata) if pool is None else pool,
        info=None
        if pool is None
        else PeerInfo(
            spec=pool.spec,
            tp_rank=cfg.pool.tp_rank,
            tp_size=cfg.pool.tp_size,
            prefix_caching=cfg.pool.prefix_caching,
        ),
        engine=engine,
        leases=leases,
        agent_name=agent.name,
        agent_metadata=metadata,
        address=address,
        metrics=metrics,
        limits=DaemonLimits(
            default_deadline_s=cfg.transfer.default_deadline_ms / 1000,
            max_inflight=cfg.transfer.max_inflight,
            lease_ttl_s=cfg.transfer.lease_ttl_ms / 1000,
            max_block_ids=cfg.transfer.max_block_ids,
            peer_timeout_s=cfg.transfer.handshake_timeout_ms / 1000,
            heartbeat_interval_s=cfg.peers.heartbeat_interval_ms / 1000,
            heartbeat_timeout_s=cfg.peers.heartbeat_timeout_ms / 1000,
        ),
        instance_id=cfg.server.instance_id or uuid.uuid4().hex,
        staging=StagingFactory(
            mode=cfg.transfer.strategy,
            model=CostModel.defaults(
                MemoryType.VRAM if mem is MemType.VRAM else MemoryType.DRAM
            ).with_overrides(
                descriptor_us=cfg.transfer.cost_descriptor_us,
                chunk_us=cfg.transfer.cost_chunk_us,
                link_gbps=cfg.transfer.cost_link_gbps,
                gather_gbps=cfg.transfer.cost_gather_gbps,
            ),
            ring=ring,
            engine=engine,
            leases=leases,
            grant_timeout_s=cfg.transfer.staging_grant_timeout_ms / 1000,
            max_block_ids=cfg.transfer.max_block_ids,
            ipc=IpcSide(
                enabled=cfg.transfer.cuda_ipc,
                host_id=host_id(),
                max_ctas=cfg.transfer.kernel_max_ctas,
                allow_slow_transport=cfg.transfer.allow_slow_transport,
                idle_s=2 * cfg.peers.heartbeat_timeout_ms / 1000,
                publisher=Publisher(enabled=cfg.transfer.cuda_ipc),
            ),
        ),
    )

    async def probe(link: PeerLink, remote: RemoteDescription) -> TransportReport:
        """Which transport serves READs from a handshaken peer (kvxferd.ipc.transport)."""
        return await probe_peer(
            agent,
            ring,
            peer_agent=remote.agent_name,
            remote_region=(
                int(remote.regions[0, 0]),
                int(remote.regions[0, 1]),
                int(remote.regions[0, 2]),
            ),
            local_vram=mem is MemType.VRAM,
            remote_vram=remote.info.spec.regions[0].memory is MemoryType.VRAM,
            same_host=bool(remote.host_id) and remote.host_id == host_id(),
        )

    def forget(agent_name: str, why: str) -> None:
        """A peer incarnation is gone: drop its CUDA IPC mappings (KERNEL pulls)."""
        kernel = daemon.staging.kernel if daemon.staging else None
        if kernel is not None:
            kernel.forget(agent_name, why)

    peer_rpcs: list[Any] = [PeerRpcMetricsInterceptor(metrics)]  # grpc-stubs: no aio type

    def channel(target: str) -> aio.Channel:
        if ccreds:
            return aio.secure_channel(target, ccreds, options=GRPC_OPTIONS, interceptors=peer_rpcs)
        return aio.insecure_channel(target, options=GRPC_OPTIONS, interceptors=peer_rpcs)

    peers = PeerDirectory(
        daemon.describe_self,
        daemon.connect_remote,
        transport_factory=lambda target: GrpcTransport(channel(target)),
        metadata=call_metadata(token),
        timeout_s=cfg.transfer.handshake_timeout_ms / 1000,
        on_handshake=daemon.observe_peer,
        allow=allow.allows if allow else None,
        max_links=cfg.peers.max_links,
        probe=probe,
        forget=forget,
    )
    daemon.attach_peers(peers)
    await daemon.owner.start_release_pump()
    undo.push_async_callback(peers.close)
    undo.push_async_callback(daemon.close)
    attacher = None
    if attached:
        attacher = Attacher(
            daemon,
            agent,
            device=cfg.pool.device,
            session_grace_s=cfg.pool.session_grace_ms / 1000,
        )
        attacher.on_change(lambda: health_changed(daemon, health_servicer))
        undo.push_async_callback(attacher.close)

    health_servicer = health_aio.HealthServicer()
    peer_pb2_grpc.add_PeerServicer_to_server(PeerService(daemon), server)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(daemon), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*TCP_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    engine_server = listeners.engine_server
    if engine_server is not None:
        engine_pb2_grpc.add_EngineServicer_to_server(EngineService(daemon, attacher), engine_server)
        reflection.enable_server_reflection(
            (SERVICE_NAMES[2], reflection.SERVICE_NAME), engine_server
        )
        await engine_server.start()
    await server.start()
    for name in (*TCP_SERVICES, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if attacher is not None:
        health_changed(daemon, health_servicer)

    metrics.add_live(_live_source(daemon, engine, asyncio.get_running_loop()))
    metrics_task = asyncio.get_running_loop().create_task(_observe_pulls(daemon, metrics))
    http, metrics_address = listeners.http, ""
    if http is not None:
        http.registry, http.daemon = registry, daemon
        threading.Thread(target=http.serve_forever, name="kvxferd-http", daemon=True).start()
        metrics_host, metrics_port = http.server_address[:2]
        metrics_address = _hostport(str(metrics_host), int(metrics_port))
    secured = "token" if token else ""
    if cfg.auth.tls_ca:
        secured = (secured + "+mtls").strip("+")
    if not secured:
        note = (
            "loopback only"
            if is_loopback(host)
            else "WARNING: anyone who reaches this port can read registered KV memory"
        )
        log.warning("no authentication configured", extra=kv(listen=address, note=note))
    log.info(
        "serving",
        extra=kv(
            grpc=address,
            engine_socket=cfg.server.engine_socket,
            metrics=metrics_address,
            agent=agent.name,
            mode=cfg.pool.mode,
            spec=pool.spec.describe() if pool is not None else "(awaiting Attach)",
            bytes=pool.spec.nbytes if pool is not None else 0,
            device=cfg.pool.device,
            auth=secured or "none",
            peers_allow=str(allow) or "any",
        ),
    )
    return Running(
        cfg,
        daemon,
        agent,
        engine,
        pump,
        server,
        engine_server,
        health_servicer,
        peers,
        address,
        cfg.server.engine_socket,
        attacher,
        metrics_address,
        http,
        registry,
        metrics_task,
    )


def health_changed(daemon: Daemon, health_servicer: health_aio.HealthServicer) -> None:
    """Readiness follows the pool in attached mode: the Peer service is NOT_SERVING while no
    pool is registered (peers would be refused), the process stays live (overall "")."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if daemon.slot.registered
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    name = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name
    task = asyncio.get_running_loop().create_task(health_servicer.set(name, status))
    _background.add(task)
    task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()


def _live_source(
    daemon: Daemon, engine: TransferEngine, loop: asyncio.AbstractEventLoop
) -> Callable[[], LiveState | None]:
    """The live metrics' source: a snapshot taken on the daemon's loop (its state is the
    loop's alone), asked for from the HTTP thread; None if the loop does not answer in 2 s."""

    def snapshot() -> LiveState:
        pulls: dict[str, int] = dict.fromkeys(ACTIVE_STATES, 0)
        for rec in daemon.reader.pulls.active():
            pulls[rec.state.value] = pulls.get(rec.state.value, 0) + 1
        links = daemon.peers.links() if daemon.peers is not None else []
        by_state: dict[str, int] = {}
        inflight: dict[str, int] = {}
        transports: dict[str, tuple[str, float]] = {}
        for link in links:
            by_state[link.state.value] = by_state.get(link.state.value, 0) + 1
            if link.remote is not None:
                inflight[link.address] = engine.inflight_bytes(link.remote.agent_name)
            t = link.transport
            if t is not None:
                gbps = 0.0 if t.read_gbps != t.read_gbps else t.read_gbps  # NaN: not probed
                transports[link.address] = (t.name, gbps)
        staging = daemon.staging
        occ = None
        if staging is not None and staging.owner is not None:
            occ = staging.owner.occupancy()
        elif staging is not None and staging.ring is not None:
            ring = staging.ring
            occ = Occupancy(
                slots=ring.info.chunks, free=ring.free_slots, reader_cap=0, local=ring.taken_slots
            )
        return LiveState(pulls, inflight, by_state, len(daemon.leases), occ, transports)

    def source() -> LiveState | None:
        if loop.is_closed():
            return None
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            return snapshot()  # scraped from the loop itself (in-process tests)
        done: concurrent.futures.Future[LiveState] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(snapshot())
            except BaseException as exc:
                done.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
            return done.result(timeout=2.0)
        except Exception:
            log.warning("live metrics unavailable: the daemon's loop did not answer")
            return None

    return source


async def _observe_pulls(daemon: Daemon, metrics: Metrics) -> None:
    """Per-peer outcome and latency of every pull, from the daemon's pull book."""
    async for rec in daemon.reader.watch(frozenset()):
        if rec.state.terminal:
            seconds = max(0.0, (rec.finished_ns - rec.created_ns) / 1e9)
            metrics.observe_pull_end(rec.peer_address, rec.state.value, seconds)


class _MetricsHandler(BaseHTTPRequestHandler):
    server: _MetricsServer

    def do_GET(self) -> None:
        registry, daemon = self.server.registry, self.server.daemon
        if registry is None or daemon is None:
            body, ctype, code = b"starting\n", "text/plain", 503
        elif self.path == "/metrics":
            body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
        elif self.path == "/healthz":
            ok = not daemon.reader.draining
            body, ctype, code = (
                (b"ok\n" if ok else b"draining\n"),
                "text/plain",
                200 if ok else 503,
            )
        else:
            body, ctype, code = b"not found: try /metrics or /healthz\n", "text/plain", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


async def serve_forever(cfg: Config, *, ready_file: str = "", fill_seed: int | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain and stop. Returns the process exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start(cfg, fill_seed=fill_seed)
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "grpc": running.grpc_address,
                    "metrics": running.metrics_address,
                    "engine_socket": running.engine_socket,
                    "pid": os.getpid(),
                }
            )
        )
        tmp.replace(ready_file)
    await stop.wait()
    log.info("stopping", extra=kv(drain_timeout_s=cfg.server.drain_timeout_s))
    await running.stop()
    return 0


__all__ = ["Running", "serve_forever", "start"]
