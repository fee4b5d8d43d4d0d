"""Checks across keys, run on every load: listeners and their security, staging, modes."""

from __future__ import annotations

import re

from kvxferd.config.addresses import is_loopback, split_hostport
from kvxferd.config.sections import DOCS, Config, TransferConfig, check_token
from kvxferd.errors import ConfigError
from kvxferd.netpolicy import PeerAllowList

BUSY_POLL_MODES = ("auto", "on", "off")  # server.busy_poll (kvxferd/busypoll.py)

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
MAX_STAGING_BYTES = 1 << 40
"""The staging ring (staging_chunks x staging_chunk_bytes) is one buffer allocated and
registered at start: past 1 TiB it is a typo, not a ring any host or GPU can hold."""


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
    for key, path, example in (
        ("server.scheduler_socket", cfg.server.scheduler_socket, "scheduler.sock"),
        ("server.engine_socket", cfg.server.engine_socket, "engine.sock"),
    ):
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise ConfigError(
                f"a Unix socket path holds at most {MAX_SOCKET_PATH} bytes, got"
                f" {len(path.encode())}",
                field=key,
                fix=f"use a shorter path (e.g. /run/kvxferd/{example})",
            )
    if cfg.server.watch_backlog < 1:
        raise ConfigError(
            f"must be >= 1, got {cfg.server.watch_backlog}",
            field="server.watch_backlog",
            fix="leave it at 16384, or give a watch stream room for at least one message",
        )
    if cfg.server.busy_poll not in BUSY_POLL_MODES:
        raise ConfigError(
            f"must be one of {', '.join(BUSY_POLL_MODES)}, got {cfg.server.busy_poll!r}",
            field="server.busy_poll",
            fix="use auto (spin where at least 8 CPUs are usable), on or off",
        )
    if not 0 < cfg.server.busy_poll_window_ms <= 1000:
        raise ConfigError(
            f"must be > 0 and <= 1000, got {cfg.server.busy_poll_window_ms}",
            field="server.busy_poll_window_ms",
            fix="leave it at 5, or set server.busy_poll = off to never spin",
        )
    if cfg.server.drain_timeout_s < 0:
        raise ConfigError(
            f"must be >= 0, got {cfg.server.drain_timeout_s}",
            field="server.drain_timeout_s",
            fix="use 0 (stop at once) or how many seconds in-flight pulls may take to finish",
        )
    if cfg.pool.session_grace_ms <= 0:
        raise ConfigError(
            f"must be positive, got {cfg.pool.session_grace_ms}",
            field="pool.session_grace_ms",
            fix="use a value > 0 (the default is 10000)",
        )
    if not (cfg.pool.device == "cpu" or re.fullmatch(r"cuda(:[0-9]+)?", cfg.pool.device)):
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
    for key, v in (
        ("nixl.progress_delay_us", cfg.nixl.progress_delay_us),
        ("nixl.num_threads", cfg.nixl.num_threads),
    ):
        if v < 0:
            raise ConfigError(f"must be >= 0, got {v}", field=key, fix="use 0 or a positive value")
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
        check_token(a.token, "auth.token")
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
    if not 1 <= t.cma_threads <= 64:
        raise ConfigError(
            f"cma_threads must be between 1 and 64, got {t.cma_threads}",
            field="transfer.cma_threads",
            fix="use 2 (two threads saturate memory bandwidth on small hosts) or up to 64",
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
    ring = t.staging_chunks * t.staging_chunk_bytes
    if ring > MAX_STAGING_BYTES:
        raise ConfigError(
            f"the staging ring of staging_chunks x staging_chunk_bytes = {t.staging_chunks} x"
            f" {t.staging_chunk_bytes} = {ring} bytes is larger than {MAX_STAGING_BYTES} (1 TiB)",
            field="transfer.staging_chunks",
            fix="lower transfer.staging_chunks or transfer.staging_chunk_bytes (default 8 x 64"
            " MiB), or set transfer.staging_chunks = 0 to disable staging",
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


__all__ = ["validate"]
