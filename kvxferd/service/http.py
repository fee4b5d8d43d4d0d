"""The daemon's HTTP port: ``/metrics`` (Prometheus text) and ``/healthz`` (draining or not)."""

from __future__ import annotations

import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

if TYPE_CHECKING:
    from kvxferd.daemon.core import Daemon


class MetricsServer(ThreadingHTTPServer):
    """/metrics and /healthz; bound at start-up, serving once the daemon exists."""

    registry: CollectorRegistry | None = None
    daemon: Daemon | None = None


class MetricsServer6(MetricsServer):
    address_family = socket.AF_INET6


class MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsServer

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


__all__ = ["MetricsHandler", "MetricsServer", "MetricsServer6"]
