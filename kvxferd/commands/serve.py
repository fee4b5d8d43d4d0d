"""``kvxferd serve``: run the daemon (systemd service or Kubernetes sidecar)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from kvxferd.commands import Subparsers
from kvxferd.config import load_config
from kvxferd.errors import ConfigError
from kvxferd.logs import setup_logging

_FLAGS = {
    "listen": "server.listen",
    "advertise": "server.advertise",
    "engine_socket": "server.engine_socket",
    "metrics_listen": "server.metrics_listen",
    "token": "auth.token",
    "preset": "pool.preset",
    "spec": "pool.spec_file",
    "device": "pool.device",
    "log_level": "log.level",
    "log_format": "log.format",
}


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="run the daemon",
        description=(
            "Run the kvxferd daemon: Peer and Scheduler gRPC services on --listen, the Engine"
            " service on --engine-socket, /metrics and /healthz on --metrics-listen. Settings"
            " come from --config (TOML), then KVXFERD_<SECTION>_<KEY> environment variables,"
            " then flags; every key is in docs/config.md. SIGTERM drains in-flight pulls for"
            " server.drain_timeout_s, then stops."
        ),
    )
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--listen", metavar="HOST:PORT", help="server.listen (port 0: any free)")
    p.add_argument("--advertise", metavar="HOST:PORT", help="server.advertise")
    p.add_argument("--engine-socket", metavar="PATH", help="server.engine_socket")
    p.add_argument("--metrics-listen", metavar="HOST:PORT", help='server.metrics_listen ("" off)')
    p.add_argument("--token", help="auth.token (prefer auth.token_file or the environment)")
    p.add_argument("--preset", help="pool.preset, e.g. dense:num_blocks=512")
    p.add_argument("--spec", metavar="FILE", help="pool.spec_file (TOML spec)")
    p.add_argument("--device", help="pool.device: cpu or cuda[:N]")
    p.add_argument("--prefix-caching", action="store_true", help="pool.prefix_caching = true")
    p.add_argument("--tp", metavar="RANK/SIZE", help="pool.tp_rank / pool.tp_size")
    p.add_argument("--log-level", help="log.level")
    p.add_argument("--log-format", choices=("json", "text"), help="log.format")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any configuration key (repeatable)",
    )
    p.add_argument("--ready-file", metavar="PATH", help="write bound addresses as JSON when up")
    p.add_argument(
        "--fill-pattern",
        type=int,
        metavar="SEED",
        help="fill the owned pool with a deterministic per-block pattern (demos and tests)",
    )
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, str]:
    out: dict[str, str] = {}
    for flag, key in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            out[key] = str(value)
    if args.prefix_caching:
        out["pool.prefix_caching"] = "true"
    if args.tp:
        rank, slash, size = args.tp.partition("/")
        if not slash or not rank.strip() or not size.strip():
            raise ConfigError(
                f"--tp {args.tp!r} is not RANK/SIZE",
                field="--tp",
                fix="write e.g. --tp 0/2 (pool.tp_rank / pool.tp_size)",
            )
        out["pool.tp_rank"], out["pool.tp_size"] = rank, size
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(
                f"--set {item!r} is not SECTION.KEY=VALUE",
                field="--set",
                fix="write e.g. --set transfer.max_inflight=64 (every key: docs/config.md)",
            )
        out[key.strip()] = value
    return out


def check_ready_file(path: str) -> None:
    """Refuse, before anything is bound, a --ready-file that could not be written."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"{path} is a directory", field="--ready-file", fix="name a file to write, not a folder"
        )
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(
            f"the directory {parent} of {path} does not exist (kvxferd does not create it)",
            field="--ready-file",
            fix=f"create {parent} first, or name a file in an existing directory",
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"the directory {parent} of {path} is not writable by this user",
            field="--ready-file",
            fix="name a file in a directory this user may write to",
        )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, overrides=overrides_from(args))
    if args.ready_file:
        check_ready_file(args.ready_file)
    setup_logging(cfg.log.level, cfg.log.format)
    from kvxferd.service.app import serve_forever

    main = serve_forever(cfg, ready_file=args.ready_file or "", fill_seed=args.fill_pattern)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.run(main)
    return uvloop.run(main)
