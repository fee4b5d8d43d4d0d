"""The configuration's sections as frozen dataclasses: every key, its default and its meaning
next to its field (docs/config.md is the reference; a test checks the two agree)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxferd.errors import ConfigError

DOCS = "docs/config.md"


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    """gRPC address for the Peer and Scheduler services (host:port; port 0 picks one)."""
    advertise: str = ""
    """Address peers and schedulers use to reach this daemon; default: the bound address."""
    engine_socket: str = ""
    """Unix socket path for the Engine service (created mode 0660); empty disables it."""
    scheduler_socket: str = ""
    """Unix socket path (mode 0660) where a caller on this host may also send the Scheduler's
    unary calls (StartPull, GetTransfer, CancelTransfer, DeclinePull, ListPeers) as framed
    protobuf, not gRPC (kvxferd.wire.scheduler_socket); empty disables it."""
    metrics_listen: str = "127.0.0.1:9400"
    """HTTP address for /metrics (Prometheus) and /healthz; empty disables it."""
    metrics_allow_remote: bool = False
    """Allow a non-loopback metrics_listen (the HTTP endpoints have no authentication)."""
    allow_insecure_remote: bool = False
    """Allow a non-loopback listen address with neither a token nor mTLS configured (and a
    non-loopback metrics_listen)."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, how long in-flight transfers may finish before the daemon stops."""
    watch_backlog: int = 16384
    """Messages a WatchTransfers or WatchReleases stream may have unsent (its caller reads
    slower than they come) before the daemon ends it with RESOURCE_EXHAUSTED."""
    instance_id: str = ""
    """Identifier of this daemon instance; default: generated at start (changes on restart)."""
    busy_poll: str = "auto"
    """Keep the event loop polling after each call arrives instead of sleeping (kvxferd.busypoll):
    ``auto`` where at least 8 CPUs are usable, ``on``, or ``off``."""
    busy_poll_window_ms: float = 5.0
    """How long the loop keeps polling after the last frame or RPC arrived, when busy polling."""


@dataclass(frozen=True)
class AuthConfig:
    token: str = ""
    """Shared token every caller must send as ``authorization: Bearer <token>`` metadata."""
    token_file: str = ""
    """File holding the token (preferred over ``token`` for secrets)."""
    tls_cert: str = ""
    """PEM server certificate; with tls_key enables TLS on the gRPC port."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_ca: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mTLS)."""
    allow_plaintext_token: bool = False
    """Allow a token without TLS on a non-loopback listen address (it crosses the network in
    clear text)."""


@dataclass(frozen=True)
class PoolConfig:
    mode: str = "owned"
    """``owned``: the daemon allocates the KV pool; ``attached``: an engine attaches it
    (needs server.engine_socket; docs/attachment.md)."""
    preset: str = "dense:num_blocks=256"
    """Preset (``name[:key=value,...]``) for an owned pool, used when spec_file is empty."""
    spec_file: str = ""
    """TOML spec (docs/spec.md) for an owned pool; overrides preset."""
    device: str = "cpu"
    """Where an owned pool lives: ``cpu`` (DRAM) or ``cuda[:N]`` (VRAM)."""
    tp_rank: int = 0
    """This worker's tensor-parallel rank."""
    tp_size: int = 1
    """This worker's tensor-parallel size."""
    prefix_caching: bool = False
    """Whether the engine beside this daemon uses prefix caching (checked at handshake)."""
    session_grace_ms: int = 10_000
    """Attached mode: detach if the engine opens no Session this long after Attach."""


@dataclass(frozen=True)
class TransferConfig:
    default_deadline_ms: int = 30_000
    """Deadline of a pull when the scheduler gives none."""
    max_inflight: int = 256
    """Transfers in flight at once; more are refused with RESOURCE_EXHAUSTED."""
    max_inflight_bytes_per_peer: int = 8 << 30
    """Bytes in flight per peer; a pull past it is refused with RESOURCE_EXHAUSTED."""
    lease_ttl_ms: int = 60_000
    """How long held blocks stay reserved for readers without a renewal."""
    max_block_ids: int = 1 << 20
    """Most block IDs accepted in one request (per group)."""
    handshake_timeout_ms: int = 5_000
    """Timeout of a handshake or lease call to a peer."""
    strategy: str = "auto"
    """``auto`` (cost model picks), ``direct``, ``staged`` or ``kernel`` (forced where possible;
    see docs/strategies.md)."""
    mode: str = "pull"
    """``pull``: the decode daemon READs the held blocks; ``push``: the prefill daemon WRITEs
    them (Peer.Push). Every daemon of a deployment must use the same (docs/nixl.md)."""
    staging_chunk_bytes: int = 64 << 20
    """Bytes of one staging slot (one chunk of a STAGED pull)."""
    staging_chunks: int = 8
    """Slots in the staging ring (one buffer, registered once); 0 disables STAGED."""
    staging_grant_timeout_ms: int = 30_000
    """How long a reader may keep an owner slot before the owner takes it back."""
    cost_descriptor_us: float = 0.0
    """Cost model: posting cost per descriptor, us (0: 6 on VRAM, 6.3 on DRAM)."""
    cost_chunk_us: float = 0.0
    """Cost model: fixed cost per staged chunk (Gather round trip), us (0: 400 VRAM, 1200 DRAM)."""
    cost_link_gbps: float = 0.0
    """Cost model: link bandwidth, GB/s (0: 394 on VRAM, 3.6 on DRAM)."""
    cost_gather_gbps: float = 0.0
    """Cost model: gather and scatter bandwidth, GB/s (0: 873 on VRAM, 1.6 on DRAM)."""
    cuda_ipc: bool = True
    """Publish the VRAM pool's CUDA IPC handles in the handshake and read same-host GPU peers
    with KERNEL pulls (SM copies over CUDA IPC); false: neither."""
    kernel_max_ctas: int = 64
    """KERNEL pulls: most CUDA thread blocks one copy launches (0: two per multiprocessor);
    the rest of the GPU stays free for the engine."""
    allow_slow_transport: bool = False
    """Allow DIRECT and STAGED pulls of GPU memory over a link probed at TCP speed (refused by
    default, with the fix; docs/nixl.md §7)."""
    cma: bool = True
    """Read same-host peers whose pools are in host memory with CMA pulls (process_vm_readv
    from the owner's process, named by the kernel on the same-host Peer socket); as an owner,
    let same-user readers do so under Yama ptrace_scope 1. false: neither (docs/strategies.md)."""
    cma_threads: int = 2
    """CMA pulls: worker threads that copy one pull's batches in parallel."""


@dataclass(frozen=True)
class NixlConfig:
    agent_name: str = ""
    """NIXL agent name; default: ``kvxferd-<host>-<pid>``."""
    num_threads: int = 0
    """UCX backend worker threads (0: NIXL's default)."""
    progress_delay_us: int = 100
    """Progress-thread sleep between polls; 0 busy-spins a core (docs/nixl.md §2)."""


@dataclass(frozen=True)
class PeersConfig:
    allow: str = ""
    """Peer addresses this daemon may connect to and send its credentials to: comma-separated
    IPs, CIDRs, host names or host:port (a TOML array also works); empty allows any."""
    heartbeat_interval_ms: int = 1_000
    """How often a reader heartbeats each peer it has pulls in flight from."""
    heartbeat_timeout_ms: int = 5_000
    """An owner ends a reader's share of a lease when it has not heard from it this long."""
    max_links: int = 1_024
    """Most peer links kept; the least recently used unreachable ones are evicted first."""
    local_socket: str = "auto"
    """The same-host Peer socket: ``auto`` serves the Peer calls of a pull's lifetime
    (ConfirmLease, heartbeats, releases, STAGED gathers) also on a Unix socket in the temporary
    directory, advertised in the handshake, and uses a peer's socket when it can reach it (a
    Heartbeat through it must reach the same instance); a path serves there instead; ``off``
    does neither (every Peer call over gRPC). Saves a gRPC round trip per call between daemons
    on one host (docs/benchmarks.md)."""


@dataclass(frozen=True)
class LogConfig:
    level: str = "INFO"
    """DEBUG, INFO, WARNING or ERROR."""
    format: str = "json"
    """``json`` (one object per line) or ``text``."""


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    nixl: NixlConfig = field(default_factory=NixlConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def resolved_token(self) -> str:
        """The token callers must present; ``""`` when none is configured.

        A configured token that resolves to nothing (an empty or whitespace-only
        ``auth.token_file``) is an error, never "no authentication"."""
        if self.auth.token_file:
            path = self.auth.token_file
            try:
                token = Path(path).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    f"cannot read token file {path}: {exc}",
                    field="auth.token_file",
                    fix="point it at a readable file holding the token",
                ) from exc
            if not token:
                raise ConfigError(
                    f"token file {path} is empty (or only whitespace): the daemon would run"
                    " without authentication",
                    field="auth.token_file",
                    fix="write the token into the file, or unset auth.token_file to run without"
                    f" a token (loopback only unless server.allow_insecure_remote; {DOCS})",
                )
            check_token(token, "auth.token_file")
            return token
        return self.auth.token


SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "auth": AuthConfig,
    "pool": PoolConfig,
    "transfer": TransferConfig,
    "nixl": NixlConfig,
    "peers": PeersConfig,
    "log": LogConfig,
}


def check_token(token: str, key: str) -> None:
    """A token must be usable in ``authorization: Bearer <token>`` metadata."""
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ConfigError(
            "the token contains whitespace, control or non-ASCII characters, which cannot"
            " travel in gRPC metadata",
            field=key,
            fix="use printable ASCII without spaces (e.g. the output of `openssl rand -hex 32`)",
        )


__all__ = [
    "DOCS",
    "SECTIONS",
    "AuthConfig",
    "Config",
    "LogConfig",
    "NixlConfig",
    "PeersConfig",
    "PoolConfig",
    "ServerConfig",
    "TransferConfig",
    "check_token",
]
