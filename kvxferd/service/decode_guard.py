"""Request bodies that do not decode: INVALID_ARGUMENT naming the expected message.

gRPC answers UNKNOWN ("Unexpected error") when a method's deserializer raises.
:class:`DecodeGuard` wraps every method's deserializer so that it never raises, and its
behaviour so that an undecodable body is refused with INVALID_ARGUMENT instead.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from kvxferd import busypoll


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
    the token interceptor refuses never parse their body. Being run for every call that arrives,
    it also keeps the loop busy polling for the rest of the call (kvxferd/busypoll.py)."""

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
        busypoll.touch()  # a call arrived: keep the loop awake for the rest of its exchange
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


__all__ = ["DecodeGuard"]
