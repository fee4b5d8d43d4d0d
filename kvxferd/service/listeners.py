"""The daemon's listeners, bound before anything is built.

The gRPC TCP port (Peer + Scheduler + health + reflection), the Engine Unix socket and the
HTTP metrics port are bound first, so that a port in use, a bad socket path or an unreadable
credential file is a one-line :class:`~kvxferd.errors.ConfigError` naming the key, before any
memory is allocated or registered.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
from dataclasses import dataclass

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from kvxferd.config import DOCS, Config, split_hostport
from kvxferd.errors import ConfigError
from kvxferd.logs import kv
from kvxferd.metrics import Metrics, RpcMetricsInterceptor
from kvxferd.service.auth import TokenInterceptor, server_credentials
from kvxferd.service.decode_guard import DecodeGuard
from kvxferd.service.http import MetricsHandler, MetricsServer, MetricsServer6
from kvxferd.v1 import engine_pb2, peer_pb2, scheduler_pb2

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


@dataclass
class Listeners:
    """Every bound listener, not yet serving."""

    server: aio.Server
    host: str
    port: int
    engine_server: aio.Server | None
    engine_socket: str
    socket_ino: int
    http: MetricsServer | None
    metrics: Metrics | None = None

    async def close(self) -> None:
        """Undo :func:`bind` when start-up fails: close servers, remove our Engine socket."""
        await self.server.stop(None)
        if self.engine_server is not None:
            await self.engine_server.stop(None)
        if self.http is not None:
            self.http.server_close()
        if self.socket_ino:
            with contextlib.suppress(OSError):
                if os.lstat(self.engine_socket).st_ino == self.socket_ino:
                    os.unlink(self.engine_socket)


async def bind(cfg: Config, token: str) -> Listeners:
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
            listeners.http = bind_http(cfg.server.metrics_listen)
    except BaseException:
        await listeners.close()
        raise
    return listeners


def hostport(host: str, port: int) -> str:
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
    bind = hostport(host, port)
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


def bind_http(listen: str) -> MetricsServer:
    key = "server.metrics_listen"
    host, port = split_hostport(listen, key)
    cls = MetricsServer6 if ":" in host else MetricsServer
    try:
        return cls((host, port), MetricsHandler)
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


__all__ = ["ENGINE_SOCKET_MODE", "GRPC_OPTIONS", "SERVER_OPTIONS", "Listeners", "bind", "hostport"]
