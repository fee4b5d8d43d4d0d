"""One validated configuration: TOML file, then ``KVXFERD_*`` environment, then flags.

Every key has its default and meaning next to its field; ``docs/config.md`` is the reference
(a test checks the two agree). Environment variables are read here and nowhere else:
``KVXFERD_<SECTION>_<KEY>`` (e.g. ``KVXFERD_SERVER_LISTEN``, ``KVXFERD_AUTH_TOKEN``); any
other ``KVXFERD_*`` variable is refused (naming the closest key) unless it is one of
:data:`NON_CONFIG_ENV`. Flags arrive as ``section.key=value`` overrides. Errors name the key and
say how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxferd.errors import ConfigError
from kvxferd.netpolicy import PeerAllowList

DOCS = "docs/config.md"


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    """gRPC address for the Peer and Scheduler services (host:port; port 0 picks one)."""
    advertise: str = ""
    """Address peers and schedulers use to reach this daemon; default: the bound address."""
    engine_socket: str = ""
    """Unix socket path for the Engine service (created mode 0660); empty disables it."""
    metrics_listen: str = "127.0.0.1:9400"
    """HTTP address for /metrics (Prometheus) and /healthz; empty disables it."""
    metrics_allow_remote: bool = False
    """Allow a non-loopback metrics_listen (the HTTP endpoints have no authentication)."""
    allow_insecure_remote: bool = False
    """Allow a non-loopback listen address with neither a token nor mTLS configured (and a
    non-loopback metrics_listen)."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, how long in-flight transfers may finish before the daemon stops."""
    instance_id: str = ""
    """Identifier of this daemon instance; default: generated at start (changes on restart)."""


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
            _check_token(token, "auth.token_file")
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


LIST_KEYS = frozenset({"peers.allow"})
"""String keys that also accept a TOML array of strings (joined with commas)."""

NON_CONFIG_ENV = frozenset(
    {
        "KVXFERD_TOOLS_CACHE",  # scripts/check_proto.sh: where pinned generators are installed
        "KVXFERD_NO_INSTALL",  # scripts/check_proto.sh: never install a missing tool
        "KVXFERD_FUZZ_SECONDS",  # tests/fuzz: how long the RPC fuzz suite runs
        "KVXFERD_FUZZ_REPORT",  # tests/fuzz: where the fuzz suite writes its JSON counts
    }
)
"""``KVXFERD_*`` variables that are not configuration keys and are never refused (tool and
test knobs; daemons started by a test run inherit them). Every other ``KVXFERD_*`` variable
must name a key (``KVXFERD_<SECTION>_<KEY>``). docs/config.md lists these too, and
tests/test_config.py checks that the repository uses no other."""


def documented_keys() -> list[str]:
    """Every ``section.key`` the configuration accepts."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def env_var(key: str) -> str:
    """The environment variable of ``section.key``: ``KVXFERD_SECTION_KEY``."""
    return "KVXFERD_" + key.replace(".", "_").upper()


def _env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """``section.key -> value`` from ``KVXFERD_*`` variables; a variable that is neither a
    key nor in :data:`NON_CONFIG_ENV` is refused, naming the closest key."""
    by_var = {env_var(k): k for k in documented_keys()}
    out: dict[str, str] = {}
    for var in sorted(environ):
        if var in by_var:
            out[by_var[var]] = environ[var]
        elif var.upper().startswith("KVXFERD_") and var not in NON_CONFIG_ENV:
            close = difflib.get_close_matches(var.upper(), by_var, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]} ({by_var[close[0]]})? " if close else ""
            raise ConfigError(
                f"unknown environment variable {var}: no configuration key is named so",
                field=var,
                fix=f"{hint}rename or unset it; variables are KVXFERD_<SECTION>_<KEY> for the keys"
                f" in {DOCS}",
            )
    return out


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Config:
    """Merge file < environment < overrides, convert types and validate."""
    raw: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {p} does not exist", fix="check --config") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
        for section, table in data.items():
            if section not in SECTIONS or not isinstance(table, dict):
                raise ConfigError(
                    f"unknown section [{section}] in {p}",
                    field=section,
                    fix=f"sections are {', '.join(SECTIONS)}",
                )
            for k, v in table.items():
                raw[section][k] = v
    environ = os.environ if env is None else env
    for key, value in _env_overrides(environ).items():
        section, name = key.split(".")
        raw[section][name] = value
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            close = difflib.get_close_matches(key, documented_keys(), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"unknown setting {key!r}",
                field=key,
                fix=f"{hint}use section.key with a key from {DOCS}",
            )
        raw[section][name] = value
    built = {s: _build(SECTIONS[s], s, raw[s]) for s in SECTIONS}
    cfg = Config(**built)
    validate(cfg)
    return cfg


def _build(cls: type[Any], section: str, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name not in fields:
            raise ConfigError(
                f"unknown key {name!r}",
                field=f"{section}.{name}",
                fix=f"keys of [{section}]: {', '.join(fields)}",
            )
        default = getattr(cls(), name)
        key = f"{section}.{name}"
        if key in LIST_KEYS and isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                raise ConfigError(
                    f"{value!r} must be a string or an array of strings",
                    field=key,
                    fix='write e.g. ["10.0.0.0/16", "prefill-0:50051"]',
                )
            kwargs[name] = ",".join(value)
            continue
        kwargs[name] = _convert(value, type(default), key)
    return cls(**kwargs)


def _convert(value: Any, typ: type, key: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{value!r} is not a boolean", field=key, fix="use true or false")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{value!r} is not a number", field=key)
        try:
            return typ(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{value!r} is not a{'n integer' if typ is int else ' number'}", field=key
            ) from exc
    if not isinstance(value, str):
        raise ConfigError(f"{value!r} must be a string", field=key, fix="quote the value")
    return value


def split_hostport(addr: str, key: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[addr]:port``) as (host without brackets, port 0..65535)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit():
        raise ConfigError(
            f"{addr!r} is not host:port",
            field=key,
            fix="write e.g. 127.0.0.1:50051 (IPv6: [::1]:50051)",
        )
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1]
        if not (host.startswith("[") and host.endswith("]")) or not _is_ipv6(inner):
            raise ConfigError(
                f"{addr!r}: brackets must hold an IPv6 address",
                field=key,
                fix="write e.g. [::1]:50051 or 127.0.0.1:50051",
            )
        host = inner
    elif ":" in host:
        raise ConfigError(
            f"{addr!r}: an IPv6 address with a port must be in brackets",
            field=key,
            fix=f"write [{host}]:{port}",
        )
    if int(port) > 65535:
        raise ConfigError(
            f"port {port} of {addr!r} is out of range",
            field=key,
            fix="use a port from 1 to 65535 (0 picks a free one)",
        )
    return host, int(port)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_token(token: str, key: str) -> None:
    """A token must be usable in ``authorization: Bearer <token>`` metadata."""
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ConfigError(
            "the token contains whitespace, control or non-ASCII characters, which cannot"
            " travel in gRPC metadata",
            field=key,
            fix="use printable ASCII without spaces (e.g. the output of `openssl rand -hex 32`)",
        )


def validate(cfg: Config) -> None:
    _validate_listeners(cfg)
    if bool(cfg.auth.tls_cert) != bool(cfg.auth.tls_key):
        raise ConfigError(
            "tls_cert and tls_key must be set together", field="auth.tls_cert", fix="set both"
        )
    if cfg.auth.tls_ca and not cfg.auth.tls_cert:
        raise ConfigError(
            "tls_ca (mTLS) needs the server's own tls_cert and tls_key",
            field="auth.tls_ca",
            fix="set auth.tls_cert and auth.tls_key",
        )
    if cfg.pool.mode not in ("owned", "attached"):
        raise ConfigError(
            f"unknown pool mode {cfg.pool.mode!r}", field="pool.mode", fix="owned or attached"
        )
    if cfg.pool.mode == "attached" and not cfg.server.engine_socket:
        raise ConfigError(
            "pool.mode = attached needs the Engine service, where the engine attaches its pool",
            field="server.engine_socket",
            fix="set server.engine_socket to a Unix socket path shared with the engine",
        )
    if cfg.pool.session_grace_ms <= 0:
        raise ConfigError(
            f"must be positive, got {cfg.pool.session_grace_ms}",
            field="pool.session_grace_ms",
            fix="use a value > 0 (the default is 10000)",
        )
    if not (cfg.pool.device == "cpu" or cfg.pool.device.startswith("cuda")):
        raise ConfigError(
            f"unknown device {cfg.pool.device!r}", field="pool.device", fix="cpu or cuda:N"
        )
    if cfg.pool.tp_size < 1 or not 0 <= cfg.pool.tp_rank < cfg.pool.tp_size:
        raise ConfigError(
            f"tp_rank {cfg.pool.tp_rank} is not in [0, tp_size={cfg.pool.tp_size})",
            field="pool.tp_rank",
            fix="set 0 <= tp_rank < tp_size",
        )
    for key, v in (
        ("transfer.default_deadline_ms", cfg.transfer.default_deadline_ms),
        ("transfer.max_inflight", cfg.transfer.max_inflight),
        ("transfer.max_inflight_bytes_per_peer", cfg.transfer.max_inflight_bytes_per_peer),
        ("transfer.lease_ttl_ms", cfg.transfer.lease_ttl_ms),
        ("transfer.max_block_ids", cfg.transfer.max_block_ids),
        ("transfer.handshake_timeout_ms", cfg.transfer.handshake_timeout_ms),
    ):
        if v <= 0:
            raise ConfigError(f"must be positive, got {v}", field=key, fix="use a value > 0")
    _validate_staging(cfg.transfer)
    if cfg.nixl.progress_delay_us < 0 or cfg.nixl.num_threads < 0:
        raise ConfigError("must be >= 0", field="nixl", fix="use 0 or a positive value")
    if cfg.log.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(
            f"unknown level {cfg.log.level!r}", field="log.level", fix="DEBUG/INFO/WARNING/ERROR"
        )
    if cfg.log.format not in ("json", "text"):
        raise ConfigError(
            f"unknown format {cfg.log.format!r}", field="log.format", fix="json or text"
        )
    PeerAllowList.parse(cfg.peers.allow)  # raises ConfigError naming peers.allow
    for key, v in (
        ("peers.heartbeat_interval_ms", cfg.peers.heartbeat_interval_ms),
        ("peers.heartbeat_timeout_ms", cfg.peers.heartbeat_timeout_ms),
        ("peers.max_links", cfg.peers.max_links),
    ):
        if v <= 0:
            raise ConfigError(f"must be positive, got {v}", field=key, fix="use a value > 0")
    if cfg.peers.heartbeat_timeout_ms <= cfg.peers.heartbeat_interval_ms:
        raise ConfigError(
            f"heartbeat_timeout_ms ({cfg.peers.heartbeat_timeout_ms}) must be larger than"
            f" heartbeat_interval_ms ({cfg.peers.heartbeat_interval_ms}), or a live reader"
            " would time out between two heartbeats",
            field="peers.heartbeat_timeout_ms",
            fix="use a timeout of several intervals (defaults: 1000 and 5000)",
        )


def _validate_listeners(cfg: Config) -> None:
    """Fail closed: who can reach each listener, and with which credentials."""
    host, _ = split_hostport(cfg.server.listen, "server.listen")
    a = cfg.auth
    if a.token and not a.token.strip():
        raise ConfigError(
            "auth.token is only whitespace: the daemon would run without authentication",
            field="auth.token",
            fix=f"set a real token, or unset auth.token to run without one ({DOCS})",
        )
    if a.token:
        _check_token(a.token, "auth.token")
    if a.token_file and not a.token_file.strip():
        raise ConfigError(
            "auth.token_file is only whitespace, not a path",
            field="auth.token_file",
            fix="point it at a file holding the token, or unset it",
        )
    has_token = bool(a.token or a.token_file)
    secured = has_token or bool(a.tls_ca)
    remote = not is_loopback(host)
    if remote and not secured and not cfg.server.allow_insecure_remote:
        raise ConfigError(
            f"listening on {host} with neither a token nor mTLS would let anyone on the"
            " network read registered KV memory",
            field="server.listen",
            fix="set auth.token (or auth.token_file) or auth.tls_ca, or set"
            f" server.allow_insecure_remote = true on a trusted network ({DOCS}, Security)",
        )
    if remote and has_token and not a.tls_cert and not a.allow_plaintext_token:
        raise ConfigError(
            f"listening on {host} without TLS would send the token in clear text: anyone who"
            " can watch the network could replay it and read registered KV memory",
            field="auth.token_file" if a.token_file else "auth.token",
            fix="enable TLS (auth.tls_cert and auth.tls_key), or set"
            f" auth.allow_plaintext_token = true on a trusted network ({DOCS}, Security)",
        )
    if cfg.server.metrics_listen:
        mhost, _ = split_hostport(cfg.server.metrics_listen, "server.metrics_listen")
        opted_in = cfg.server.metrics_allow_remote or cfg.server.allow_insecure_remote
        if not is_loopback(mhost) and not opted_in:
            raise ConfigError(
                f"/metrics and /healthz on {mhost} have no authentication: anyone on the"
                " network could read them",
                field="server.metrics_listen",
                fix="listen on loopback (127.0.0.1:9400), or set server.metrics_allow_remote"
                f" = true and firewall the port to your monitoring network ({DOCS}, Security)",
            )


def _validate_staging(t: TransferConfig) -> None:
    if t.mode not in ("pull", "push"):
        raise ConfigError(
            f"unknown transfer mode {t.mode!r}",
            field="transfer.mode",
            fix="pull (the decode daemon reads) or push (the prefill daemon writes); the same"
            " on every daemon of the deployment",
        )
    if t.strategy not in ("auto", "direct", "staged", "kernel"):
        raise ConfigError(
            f"unknown strategy {t.strategy!r}",
            field="transfer.strategy",
            fix="auto, direct, staged or kernel",
        )
    if not 0 <= t.kernel_max_ctas <= 65535:
        raise ConfigError(
            f"kernel_max_ctas must be between 0 and 65535, got {t.kernel_max_ctas}",
            field="transfer.kernel_max_ctas",
            fix="use 0 (two thread blocks per multiprocessor) or a cap such as 64",
        )
    if t.staging_chunks < 0 or t.staging_chunks == 1:
        raise ConfigError(
            f"staging_chunks must be 0 (off) or >= 2, got {t.staging_chunks}",
            field="transfer.staging_chunks",
            fix="use 0 to disable staging, or 2 or more slots (readers may hold at most half)",
        )
    if t.staging_chunk_bytes <= 0 or t.staging_grant_timeout_ms <= 0:
        raise ConfigError(
            "staging_chunk_bytes and staging_grant_timeout_ms must be positive",
            field="transfer.staging_chunk_bytes",
            fix="use values > 0 (set staging_chunks = 0 to disable staging)",
        )
    if t.strategy == "staged" and t.staging_chunks == 0:
        raise ConfigError(
            "strategy = staged needs a staging ring, but staging_chunks = 0",
            field="transfer.strategy",
            fix="set transfer.staging_chunks >= 2 or use strategy = auto or direct",
        )
    for name in ("cost_descriptor_us", "cost_chunk_us", "cost_link_gbps", "cost_gather_gbps"):
        if getattr(t, name) < 0:
            raise ConfigError(
                f"must be >= 0, got {getattr(t, name)}",
                field=f"transfer.{name}",
                fix="use 0 for the built-in default or a positive figure",
            )
