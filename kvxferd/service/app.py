"""Wiring: build every part from one Config, serve until SIGTERM/SIGINT, drain, stop.

This is the one place where parts are constructed and started. Order on start: pool, NIXL
agent + registration, transfer engine, lease table + notification pump, daemon, gRPC servers
(TCP for Peer + Scheduler + health + reflection; Unix socket for Engine), HTTP metrics.
On stop: health NOT_SERVING, drain pulls up to ``server.drain_timeout_s``, stop servers,
stop engine and pump, deregister, close the agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from grpc import aio
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvxferd.config import Config, is_loopback, split_hostport
from kvxferd.daemon.attach import Attacher
from kvxferd.daemon.core import Daemon, DaemonLimits
from kvxferd.daemon.peers import PeerDirectory, remote_error
from kvxferd.daemon.slot import PoolSlot
from kvxferd.errors import ConfigError
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.layout.tomlspec import load_spec
from kvxferd.logs import kv
from kvxferd.metrics import Metrics
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
from kvxferd.staging.setup import StagingFactory
from kvxferd.transfer import EngineOptions, LeaseTable, NotificationPump, TransferEngine
from kvxferd.transfer.strategy import CostModel
from kvxferd.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

log = logging.getLogger(__name__)

# Requests carry up to transfer.max_block_ids IDs per group (about 10 bytes each as varints).
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)

SERVICE_NAMES = (
    peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name,
    scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
    engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name,
)


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

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        cancelled = await self.daemon.drain(self.cfg.server.drain_timeout_s)
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
    """Build, register and start everything; returns once every port is bound."""
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
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
    agent = NixlAgent(
        _agent_name(cfg),
        cuda_device=cuda,
        options=AgentOptions(
            progress_delay_us=cfg.nixl.progress_delay_us, num_threads=cfg.nixl.num_threads
        ),
    )
    agent.start()
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
    metrics.registered_bytes.set(int(engine_rows[:, 1].sum()))
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
    leases = LeaseTable(max_ttl_s=max(600.0, cfg.transfer.lease_ttl_ms / 1000))
    pump = NotificationPump(agent, leases)
    pump.start()

    token = cfg.resolved_token()
    interceptors = [TokenInterceptor(token)] if token else []
    server = aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
    creds = server_credentials(cfg.auth)
    host, port = split_hostport(cfg.server.listen, "server.listen")
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
    if bound == 0:
        raise ConfigError(f"cannot bind {bind}", field="server.listen", fix="pick a free port")
    address = cfg.server.advertise or f"{host}:{bound}"
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
        ),
        instance_id=cfg.server.instance_id or uuid.uuid4().hex,
        call_metadata=call_metadata(token),
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
            call_metadata=call_metadata(token),
            remote_error=remote_error,
        ),
    )
    ccreds = channel_credentials(cfg.auth)

    def channel(target: str) -> aio.Channel:
        if ccreds:
            return aio.secure_channel(target, ccreds, options=GRPC_OPTIONS)
        return aio.insecure_channel(target, options=GRPC_OPTIONS)

    peers = PeerDirectory(
        daemon.describe_self,
        daemon.connect_remote,
        channel_factory=channel,
        metadata=call_metadata(token),
        timeout_s=cfg.transfer.handshake_timeout_ms / 1000,
        on_handshake=daemon.observe_peer,
    )
    daemon.attach_peers(peers)
    await daemon.start_release_pump()
    attacher = None
    if attached:
        attacher = Attacher(
            daemon,
            agent,
            device=cfg.pool.device,
            session_grace_s=cfg.pool.session_grace_ms / 1000,
        )
        attacher.on_change(lambda: health_changed(daemon, health_servicer))

    health_servicer = health_aio.HealthServicer()
    peer_pb2_grpc.add_PeerServicer_to_server(PeerService(daemon), server)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(daemon), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    engine_server = None
    if cfg.server.engine_socket:
        engine_server = aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
        engine_pb2_grpc.add_EngineServicer_to_server(EngineService(daemon, attacher), engine_server)
        Path(cfg.server.engine_socket).unlink(missing_ok=True)
        engine_server.add_insecure_port(f"unix:{cfg.server.engine_socket}")
        await engine_server.start()
    await server.start()
    for name in (*SERVICE_NAMES, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if attacher is not None:
        health_changed(daemon, health_servicer)

    http, metrics_address = None, ""
    if cfg.server.metrics_listen:
        http = _http_server(cfg.server.metrics_listen, registry, daemon)
        metrics_host, metrics_port = http.server_address[:2]
        metrics_address = f"{metrics_host!s}:{metrics_port}"
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


def _http_server(listen: str, registry: CollectorRegistry, daemon: Daemon) -> ThreadingHTTPServer:
    host, port = split_hostport(listen, "server.metrics_listen")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
            elif self.path == "/healthz":
                ok = not daemon.draining
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

    srv = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=srv.serve_forever, name="kvxferd-http", daemon=True).start()
    return srv


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
