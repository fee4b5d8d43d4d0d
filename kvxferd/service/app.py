"""Wiring: build every part from one Config, serve until SIGTERM/SIGINT, drain, stop.

This is the one place where parts are constructed and started. Order on start: resolve the
token and TLS files, bind every listener (gRPC TCP port for Peer + Scheduler + health +
reflection, the Engine Unix socket, HTTP metrics) so that a port in use or a bad path is a
one-line :class:`~kvxferd.errors.ConfigError` before any memory is allocated or registered;
then pool, NIXL agent + registration, transfer engine, lease table + notification pump,
daemon; then start serving. A failure part-way undoes what was built, in reverse.
On stop: health NOT_SERVING, drain pulls up to ``server.drain_timeout_s``, stop servers,
stop engine and pump, deregister, close the agent.

Every gRPC server gets :class:`~kvxferd.service.decode_guard.DecodeGuard`, so a request body
that is not the method's protobuf message is INVALID_ARGUMENT (grpc's own answer would be
UNKNOWN).

The parts live beside this module: :mod:`~kvxferd.service.listeners` (binding), ``memory``
(pool, agent, registrations, engine), ``compose`` (the daemon from its config sections),
``live`` (what ``/metrics`` reads), ``http``, and ``heap`` (the collector while serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvxferd import busypoll
from kvxferd.config import Config, is_loopback
from kvxferd.daemon.attach import Attacher
from kvxferd.daemon.core import Daemon
from kvxferd.daemon.peers import PeerDirectory, PeerLink, RemoteDescription
from kvxferd.daemon.quiesce import drain
from kvxferd.ipc.host import host_id
from kvxferd.ipc.transport import TransportReport, probe_peer
from kvxferd.layout.spec import MemoryType
from kvxferd.logs import kv
from kvxferd.metrics import MeteredTransport, Metrics, PeerRpcMetricsInterceptor
from kvxferd.netpolicy import PeerAllowList
from kvxferd.nixl import MemType, NixlAgent
from kvxferd.service.auth import call_metadata, channel_credentials
from kvxferd.service.compose import compose_daemon
from kvxferd.service.heap import serving_heap
from kvxferd.service.listeners import GRPC_OPTIONS, Listeners, bind, hostport
from kvxferd.service.live import live_source, observe_pulls
from kvxferd.service.local_peer import LocalPeerServer
from kvxferd.service.memory import open_memory, pool_spec
from kvxferd.service.servicers import EngineService, PeerService, SchedulerService
from kvxferd.service.sockets import serve_sockets
from kvxferd.transfer import LeaseTable, NotificationPump, TransferEngine
from kvxferd.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.local import LocalTransport
from kvxferd.wire.peer_client import GrpcTransport, Transport

log = logging.getLogger(__name__)

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
    local_servers: tuple[LocalPeerServer, ...] = ()  # the Peer and scheduler sockets

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        cancelled = await drain(self.daemon.reader, self.cfg.server.drain_timeout_s)
        await self.server.stop(grace=1.0)
        for local in self.local_servers:
            await local.close()
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


async def start(
    cfg: Config,
    *,
    fill_seed: int | None = None,
    peer_transport: Callable[[str], Transport] | None = None,
) -> Running:
    """Bind, build, register and start everything; returns once every port serves.

    ``peer_transport(address)``: how this daemon reaches peer daemons; gRPC channels when
    None. Tests pass an in-process :class:`~kvxferd.wire.peer_client.FakeTransport` to play an
    owner that misbehaves in ways a real one cannot be made to.

    Listeners are bound before any memory is allocated or registered: a port in use, a bad
    socket path or an unreadable credential file is a ConfigError naming the key, with nothing
    to undo. A later failure closes what was built, in reverse order, and re-raises."""
    token = cfg.resolved_token()  # an empty token file is refused here, never "no auth"
    allow = PeerAllowList.parse(cfg.peers.allow)
    ccreds = channel_credentials(cfg.auth)
    async with contextlib.AsyncExitStack() as undo:
        listeners = await bind(cfg, token)
        undo.push_async_callback(listeners.close)
        running = await _build(
            cfg,
            token=token,
            allow=allow,
            ccreds=ccreds,
            listeners=listeners,
            undo=undo,
            fill_seed=fill_seed,
            peer_transport=peer_transport,
        )
        undo.pop_all()
    return running


async def _build(
    cfg: Config,
    *,
    token: str,
    allow: PeerAllowList,
    ccreds: grpc.ChannelCredentials | None,
    listeners: Listeners,
    undo: contextlib.AsyncExitStack,
    fill_seed: int | None,
    peer_transport: Callable[[str], Transport] | None,
) -> Running:
    metrics = listeners.metrics or Metrics.create(CollectorRegistry())
    registry = metrics.registry
    attached = cfg.pool.mode == "attached"
    memory = await open_memory(cfg, metrics, undo, fill_seed)
    pool, agent, mem, ring, engine = (
        memory.pool,
        memory.agent,
        memory.mem,
        memory.ring,
        memory.engine,
    )
    leases = LeaseTable(max_ttl_s=max(600.0, cfg.transfer.lease_ttl_ms / 1000))
    pump = NotificationPump(
        agent, leases, on_result=lambda result: metrics.notifications.labels(result).inc()
    )
    pump.start()
    undo.callback(pump.stop)

    server = listeners.server
    host, bound = listeners.host, listeners.port
    address = cfg.server.advertise or hostport(host, bound)
    daemon = compose_daemon(cfg, memory, leases, metrics, address)
    pump.on_write_done = daemon.reader.receiver.landed  # push mode: a WRITE landed here
    pump.expecting = daemon.reader.receiver.expecting

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
            kernel_only=remote.kernel_only,
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
        transport_factory=peer_transport or (lambda target: GrpcTransport(channel(target))),
        metadata=call_metadata(token),
        timeout_s=cfg.transfer.handshake_timeout_ms / 1000,
        on_handshake=daemon.observe_peer,
        allow=allow.allows if allow else None,
        max_links=cfg.peers.max_links,
        probe=probe,
        forget=forget,
        local=(lambda path: MeteredTransport(LocalTransport(path), metrics))
        if cfg.peers.local_socket != "off"
        else None,
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
        attacher.on_change(lambda: peers.stale_all("this daemon's pool was attached or detached"))
        undo.push_async_callback(attacher.close)

    health_servicer = health_aio.HealthServicer()
    peer_service = PeerService(daemon)
    peer_pb2_grpc.add_PeerServicer_to_server(peer_service, server)
    scheduler = SchedulerService(daemon)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    sockets = await serve_sockets(cfg, peer_service, scheduler, metrics, token=token, d=daemon)
    for local in sockets:
        undo.push_async_callback(local.close)
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

    metrics.add_live(live_source(daemon, engine, asyncio.get_running_loop()))
    observe_pulls(daemon, metrics)
    http, metrics_address = listeners.http, ""
    if http is not None:
        http.registry, http.daemon = registry, daemon
        threading.Thread(target=http.serve_forever, name="kvxferd-http", daemon=True).start()
        metrics_host, metrics_port = http.server_address[:2]
        metrics_address = hostport(str(metrics_host), int(metrics_port))
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
            peer_socket=daemon.local_socket,
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
        sockets,
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


async def serve_forever(cfg: Config, *, ready_file: str = "", fill_seed: int | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain and stop. Returns the process exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start(cfg, fill_seed=fill_seed)
    if ready_file:
        ready = {
            "grpc": running.grpc_address,
            "metrics": running.metrics_address,
            "engine_socket": running.engine_socket,
            "peer_socket": running.daemon.local_socket,
            "scheduler_socket": cfg.server.scheduler_socket,
            "pid": os.getpid(),
        }
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(ready_file)
    # Start-up's objects out of the collector's walks (heap.py); the loop polls while busy.
    window_ms = cfg.server.busy_poll_window_ms
    with serving_heap(), busypoll.polling(cfg.server.busy_poll, window_ms) as poll:
        running.pump.prompt_reads(window_ms / 1e3, spin=poll is not None)  # READ_DONEs due
        await stop.wait()
        log.info("stopping", extra=kv(drain_timeout_s=cfg.server.drain_timeout_s))
        await running.stop()
    return 0


__all__ = [
    "PEER_SERVICE",
    "SERVICE_NAMES",
    "TCP_SERVICES",
    "Running",
    "pool_spec",
    "serve_forever",
    "start",
]
