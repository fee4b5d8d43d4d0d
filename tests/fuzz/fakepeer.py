"""A malicious owner: a Peer service in the test process whose every answer is fuzzed.

The decode daemon is asked to pull from it (StartPull with its address); it then handshakes,
confirms the lease, maybe gathers, heartbeats and releases against answers drawn from
Hypothesis (mutations of valid answers, messages generated from the descriptors, raw bytes, or
an error status). The fake peer's identity is a NIXL agent of the test process
(``fuzz-peer-<pid>``) with the prefill daemon's spec and registrations, so handshakes pass the
compatibility check and the pull gets as far as the answers allow; its READs are refused by
NIXL (nothing of that size is registered under that agent), never served by a real daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import strategies as st

from kvxferd.v1 import peer_pb2
from tests.fuzz import protofuzz as pf

METHODS = (
    "Handshake",
    "ConfirmLease",
    "ExtendLease",
    "ReleaseLease",
    "Heartbeat",
    "Gather",
    "ReleaseStaging",
)
OUTPUTS = {m.name: m.output_type for m in peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods}
ERROR_CODES = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
)


@dataclass
class Answer:
    """What one method answers: a body, or an error status."""

    body: bytes = b""
    error: grpc.StatusCode | None = None


@dataclass
class Script:
    """The answers of one fake-peer incarnation, per method (unset: an empty message)."""

    answers: dict[str, Answer] = field(default_factory=dict)

    def describe(self) -> str:
        parts = []
        for name in METHODS:
            a = self.answers.get(name)
            if a is None:
                continue
            if a.error is not None:
                parts.append(f"{name}: abort {a.error.name}")
            else:
                parts.append(f"{name}: {_show(name, a.body)}")
        return "; ".join(parts)


def _show(method: str, body: bytes) -> str:
    from google.protobuf import message_factory, text_format

    cls = message_factory.GetMessageClass(OUTPUTS[method])
    try:
        msg = cls.FromString(body)
    except Exception:
        return f"undecodable {body[:200]!r}"
    extra = ""
    if method == "Handshake" and msg.payload:
        try:
            inner = peer_pb2.HandshakePayload.FromString(msg.payload)
        except Exception:
            pass
        else:
            inner.ClearField("nixl_agent_metadata")  # long and never the point
            msg.ClearField("payload")
            shown = text_format.MessageToString(inner, as_one_line=True)
            extra = f" payload=HandshakePayload{{{shown}}}"
    return (text_format.MessageToString(msg, as_one_line=True) + extra)[:2000]


class FakePeer:
    """One incarnation of the fake peer: a gRPC server on a fresh port answering ``script``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        handlers = {name: self._handler(name) for name in METHODS}
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("kvxferd.v1.Peer", handlers)]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _handler(self, name: str) -> grpc.RpcMethodHandler[Any, Any]:
        def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                self.calls.append(name)
            a = self.script.answers.get(name, Answer())
            if a.error is not None:
                context.abort(a.error, f"fake peer: {a.error.name}")
            return a.body

        return grpc.unary_unary_rpc_method_handler(
            answer, request_deserializer=None, response_serializer=None
        )

    def stop(self) -> None:
        self.server.stop(None)


def scripts(
    bases: Callable[[], dict[str, list[Any]]], hints: pf.Hints
) -> st.SearchStrategy[Script]:
    """Scripts whose answers are mostly mutated valid answers (so the pull gets far), some
    generated from the descriptors, some raw bytes, some error statuses."""

    def one(name: str) -> st.SearchStrategy[Answer]:
        valid = pf.mutated(lambda: bases()[name], hints).map(lambda m: m.SerializeToString())
        generated = pf.messages(OUTPUTS[name], hints).map(lambda m: m.SerializeToString())
        return st.one_of(
            valid.map(Answer),
            valid.map(Answer),
            valid.map(Answer),
            generated.map(Answer),
            st.binary(max_size=64).map(Answer),
            st.sampled_from(ERROR_CODES).map(lambda c: Answer(error=c)),
        )

    return st.fixed_dictionaries({name: one(name) for name in METHODS}).map(Script)
