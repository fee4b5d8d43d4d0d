"""Per-RPC series: every call a server answers, and every call this daemon makes to a peer."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

if TYPE_CHECKING:
    from kvxferd.metrics.series import Metrics


def code_name(code: object) -> str:
    """A status code as its name (``OK``, ``NOT_FOUND``), whatever form grpc returned it in."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return c.name
    return "UNKNOWN"


def split_method(full: str) -> tuple[str, str]:
    """``/kvxferd.v1.Peer/Handshake`` -> (``kvxferd.v1.Peer``, ``Handshake``)."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method


_Behavior = Callable[..., Any]


def observe_served(m: Metrics, service: str, method: str, code: str, t0: float | None) -> None:
    """One call a server answered (``t0``: when it started, None for a stream: not timed)."""
    m.child(m.rpcs, service, method, code).inc()
    if t0 is not None:
        seconds = time.perf_counter() - t0
        m.child(m.rpc_seconds, service, method).observe(seconds)
        if service == "kvxferd.v1.Peer" and method == "Handshake":
            m.handshake_seconds.labels("server").observe(seconds)


def observe_peer_call(m: Metrics, method: str, code: str, t0: float) -> None:
    """One call this daemon made to a peer's Peer service, started at ``t0``."""
    seconds = time.perf_counter() - t0
    m.child(m.peer_rpcs, method, code).inc()
    m.child(m.peer_rpc_seconds, method).observe(seconds)
    if method == "Handshake":
        m.handshake_seconds.labels("client").observe(seconds)


class RpcMetricsInterceptor(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every call a server answers (``kvxferd_rpcs_total``) and times unary answers
    (``kvxferd_rpc_duration_seconds``). Put it first in the server's interceptors: it then
    also counts calls the later ones refuse (UNAUTHENTICATED, INVALID_ARGUMENT).

    Only methods in ``known`` get their own label values (a caller picks the method name);
    the rest are counted as ``service="unknown"``."""

    def __init__(self, metrics: Metrics, known: Iterable[str]) -> None:
        self._m = metrics
        self._known = frozenset(known)
        self._cache: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], Any]] = {}
        # The codes alerts select exist at 0 from the start (KvxferdRpcInternalErrors,
        # KvxferdBackPressure): a quiet daemon answers those queries with 0, not nothing.
        for full in sorted(self._known):
            service, method = split_method(full)
            if service.startswith("kvxferd."):
                metrics.rpcs.labels(service, method, "INTERNAL")
                if method == "StartPull":
                    metrics.rpcs.labels(service, method, "RESOURCE_EXHAUSTED")

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None:
            return handler
        full: str = details.method
        cached = self._cache.get(full)
        if cached is not None and cached[0] is handler:
            return cached[1]  # type: ignore[no-any-return]
        service, method = split_method(full) if full in self._known else ("unknown", "unknown")
        wrapped = self._wrap(handler, service, method)
        if full in self._known:
            self._cache[full] = (handler, wrapped)
        return wrapped

    def _done(self, service: str, method: str, code: str, t0: float | None) -> None:
        observe_served(self._m, service, method, code, t0)

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], service: str, method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        behavior: _Behavior | None = (
            handler.stream_stream
            or handler.stream_unary
            or handler.unary_stream
            or handler.unary_unary
        )
        if behavior is None:
            return handler
        timed = not handler.response_streaming
        done = self._done
        wrapped: _Behavior
        if inspect.isasyncgenfunction(behavior):
            gen_behavior = behavior

            async def generator(request: Any, context: Any) -> AsyncIterator[Any]:
                t0 = time.perf_counter() if timed else None
                code = "UNKNOWN"
                try:
                    async for response in gen_behavior(request, context):
                        yield response
                    code = _final_code(context, "OK")
                except BaseException as exc:
                    code = _final_code(context, _exc_code(exc))
                    raise
                finally:
                    done(service, method, code, t0)

            wrapped = generator
        elif inspect.iscoroutinefunction(behavior):
            co_behavior = behavior

            async def coroutine(request: Any, context: Any) -> Any:
                t0 = time.perf_counter() if timed else None
                code = "UNKNOWN"
                try:
                    response = await co_behavior(request, context)
                    code = _final_code(context, "OK")
                    return response
                except BaseException as exc:
                    code = _final_code(context, _exc_code(exc))
                    raise
                finally:
                    done(service, method, code, t0)

            wrapped = coroutine
        else:
            return handler  # a synchronous behaviour (none of ours): left uncounted
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _exc_code(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


def _final_code(context: Any, default: str) -> str:
    """The code the servicer set (``set_code`` or ``abort``), else ``default``."""
    try:
        code = context.code()
    except Exception:
        return default
    if code is None:
        return default
    name = code_name(code)
    return default if name == "OK" and default != "OK" else name


class PeerRpcMetricsInterceptor(aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """On the channels a daemon opens to its peers: counts and times each Peer call
    (``kvxferd_peer_rpcs_total``, ``kvxferd_peer_rpc_duration_seconds``; Handshake also in
    ``kvxferd_handshake_duration_seconds{side="client"}``)."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._methods: dict[str, str] = {}

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        t0 = time.perf_counter()
        call = await continuation(client_call_details, request)
        raw = client_call_details.method
        full = raw.decode() if isinstance(raw, bytes) else str(raw)
        service, method = split_method(full)
        if service != "kvxferd.v1.Peer":
            method = "other"
        code = "UNKNOWN"
        try:
            await call
            code = "OK"
        except aio.AioRpcError as exc:
            code = code_name(exc.code())
        except BaseException as exc:
            code = _exc_code(exc)
            raise
        finally:
            observe_peer_call(self._m, method, code, t0)
        return call


class MeteredTransport:
    """A Peer transport (:class:`kvxferd.wire.peer_client.Transport`) whose calls count in the
    same series as :class:`PeerRpcMetricsInterceptor`'s: what the same-host socket
    (:mod:`kvxferd.wire.local`) carries is timed like a gRPC call."""

    def __init__(self, inner: Any, metrics: Metrics) -> None:
        self._inner = inner
        self._m = metrics

    @property
    def inner(self) -> Any:
        """The transport it meters (a CMA reader asks the same-host socket who it reaches)."""
        return self._inner

    async def __call__(self, method: str, request: Any, *, timeout: float, metadata: Any) -> Any:
        t0 = time.perf_counter()
        code = "UNKNOWN"
        try:
            answer = await self._inner(method, request, timeout=timeout, metadata=metadata)
            code = "OK"
            return answer
        except grpc.RpcError as exc:
            code = code_name(exc.code())
            raise
        except BaseException as exc:
            code = _exc_code(exc)
            raise
        finally:
            observe_peer_call(self._m, method, code, t0)

    async def close(self) -> None:
        await self._inner.close()


__all__ = [
    "MeteredTransport",
    "PeerRpcMetricsInterceptor",
    "RpcMetricsInterceptor",
    "code_name",
    "observe_peer_call",
    "observe_served",
    "split_method",
]
