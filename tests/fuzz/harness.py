"""The fuzz harness: call any RPC of a real daemon with raw bytes, judge and count the outcome.

Every call goes through a generic ``channel.unary_unary`` / ``unary_stream`` with no
serializer, so the body is exactly the bytes given (a serialized message or anything else).
A call is *bad* when its status is INTERNAL or UNKNOWN (an unhandled exception or a request
the server could not decode and did not refuse properly) or when any daemon's process is gone
afterwards. Bad outcomes are grouped by (RPC, code, message shape); each group keeps its
smallest request as the repro.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor as _d
from google.protobuf import text_format

from kvxferd.v1 import engine_pb2, peer_pb2, scheduler_pb2

BAD_CODES = frozenset({"INTERNAL", "UNKNOWN"})
UNARY_TIMEOUT_S = 5.0
STREAM_WINDOW_S = 0.05  # a stream still open after this is fine: we cancel it
STREAM_MAX_MESSAGES = 16

DEFAULT_SECONDS = 40.0
ENV_SECONDS = "KVXFERD_FUZZ_SECONDS"
ENV_REPORT = "KVXFERD_FUZZ_REPORT"


def budget_s() -> float:
    """Total fuzzing time of the suite, seconds (``KVXFERD_FUZZ_SECONDS``, default 40)."""
    raw = os.environ.get(ENV_SECONDS, "").strip()
    if not raw:
        return DEFAULT_SECONDS
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{ENV_SECONDS} must be > 0 seconds, got {raw!r}")
    return value


# How the fuzzing time is shared: each fuzz test's weight (by test function name).
WEIGHTS = {
    "test_fuzz_generated_messages": 2.0,
    "test_fuzz_raw_bodies": 1.0,
    "test_fuzz_reader_against_a_malicious_peer": 6.0,
}


@dataclass
class Budget:
    """The fuzzing seconds left and the weight of the fuzz tests still to run: each test gets
    its weight's part of what is left, so overruns of early tests shorten later ones and the
    whole suite fuzzes for about ``KVXFERD_FUZZ_SECONDS``."""

    left_s: float = 0.0
    left_weight: float = 0.0

    def plan(self, weights: list[float]) -> None:
        self.left_s = budget_s()
        self.left_weight = sum(weights)

    def share(self, weight: float) -> float:
        if self.left_weight <= 0:  # run outside a planned session (e.g. by hand)
            self.plan([weight])
        return max(0.0, self.left_s) * weight / max(weight, self.left_weight)

    def spend(self, weight: float, seconds: float) -> None:
        self.left_s -= seconds
        self.left_weight -= weight


BUDGET = Budget()


@dataclass(frozen=True)
class Rpc:
    """One RPC of one service: where it is served and what it takes."""

    service: str  # "Peer", "Scheduler" or "Engine"
    name: str
    path: str  # "/kvxferd.v1.Peer/Handshake"
    input: _d.Descriptor
    streaming: bool

    @property
    def id(self) -> str:
        return f"{self.service}.{self.name}"


def all_rpcs() -> list[Rpc]:
    out = []
    for module, service in (
        (peer_pb2, "Peer"),
        (scheduler_pb2, "Scheduler"),
        (engine_pb2, "Engine"),
    ):
        sd = module.DESCRIPTOR.services_by_name[service]
        for m in sd.methods:
            out.append(
                Rpc(service, m.name, f"/{sd.full_name}/{m.name}", m.input_type, m.server_streaming)
            )
    return out


@dataclass(frozen=True)
class Outcome:
    code: str  # "OK", a grpc.StatusCode name, or "OPEN" (a stream we cancelled)
    details: str = ""
    body: bytes = b""  # the unary response, when OK
    messages: int = 0  # stream messages received


@dataclass
class Failure:
    rpc: str
    target: str
    code: str
    details: str
    body: bytes
    kind: str  # "message" or "raw"
    count: int = 1

    def repro(self) -> str:
        shown = self.details if len(self.details) < 400 else self.details[:400] + "..."
        return (
            f"{self.rpc} on {self.target} -> {self.code}: {shown}\n"
            f"    seen {self.count}x; smallest {self.kind} body ({len(self.body)} bytes):"
            f" {describe_body(self.rpc, self.body)}"
        )


def describe_body(rpc_id: str, body: bytes) -> str:
    """The body as text format when it decodes as the RPC's request, else as a bytes literal."""
    rpc = next((r for r in all_rpcs() if r.id == rpc_id), None)
    raw = repr(body if len(body) <= 300 else body[:300]) + ("..." if len(body) > 300 else "")
    if rpc is None:
        return raw
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(rpc.input)()
    try:
        msg.ParseFromString(body)
    except Exception:
        return f"undecodable {raw}"
    text = text_format.MessageToString(msg, as_one_line=True, print_unknown_fields=True)
    for f in rpc.input.fields:
        nested = NESTED.get(f.full_name)
        if nested is not None and getattr(msg, f.name):
            inner = nested()
            try:
                inner.ParseFromString(getattr(msg, f.name))
            except Exception:
                continue
            shown = text_format.MessageToString(inner, as_one_line=True)
            text += f" ({f.name} decodes as {inner.DESCRIPTOR.name}{{{shown}}})"
    if len(text) > 1500:
        text = text[:1500] + "..."
    return f"{rpc.input.name}{{{text}}} = {raw}"


def _shape(details: str) -> str:
    """A failure's message with the variable parts blurred, so repeats group together."""
    s = re.sub(r"0x[0-9a-fA-F]+|\d+", "#", details)
    s = re.sub(r"'[^']*'", "'…'", s)
    return s[:120]


@dataclass
class Stats:
    """Counts for the whole session (printed at the end; JSON in KVXFERD_FUZZ_REPORT)."""

    calls: Counter[str] = field(default_factory=Counter)  # rpc id -> calls (both kinds)
    raw: Counter[str] = field(default_factory=Counter)  # rpc id -> raw-body calls
    peer: Counter[str] = field(default_factory=Counter)  # pulls from the malicious owner
    codes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    seconds: Counter[str] = field(default_factory=Counter)
    failures: dict[tuple[str, str, str, str], Failure] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def record(self, rpc: Rpc, kind: str, target: str, body: bytes, out: Outcome) -> bool:
        """Count one call; True when it was bad and of a kind not seen before."""
        self.calls[rpc.id] += 1
        if kind in ("raw", "peer"):
            (self.raw if kind == "raw" else self.peer)[rpc.id] += 1
        self.codes[rpc.id][out.code] += 1
        if out.code in BAD_CODES:
            return self.fail(rpc.id, kind, target, out.code, out.details, body)
        return False

    def fail(  # noqa: PLR0917
        self, rpc: str, kind: str, target: str, code: str, details: str, body: bytes
    ) -> bool:
        key = (rpc, kind, code, _shape(details))
        old = self.failures.get(key)
        if old is None:
            self.failures[key] = Failure(rpc, target, code, details, body, kind)
            return True
        old.count += 1
        if len(body) < len(old.body):
            old.target, old.details, old.body = target, details, body
        return False

    def shrunk(self, rpc: str, kind: str, code: str, details: str, body: bytes) -> None:
        """Replace the repro of a failure with a smaller request that fails the same way."""
        f = self.failures.get((rpc, kind, code, _shape(details)))
        if f is not None and len(body) < len(f.body):
            f.body = body

    def failures_of(self, rpc_id: str, kind: str) -> list[Failure]:
        return [f for f in self.failures.values() if f.rpc == rpc_id and f.kind == kind]

    def summary(self) -> str:
        total = sum(self.calls.values())
        raw = sum(self.raw.values())
        peer = sum(self.peer.values())
        secs = sum(self.seconds.values())
        lines = [
            f"kvxferd fuzz: {total} calls ({total - raw - peer} generated messages, {raw} raw"
            f" bodies, {peer} pulls from a malicious owner) over {len(self.calls)} RPCs in"
            f" {secs:.1f}s of fuzzing"
            f" ({ENV_SECONDS}={budget_s():g}); {len(self.failures)} distinct bad outcomes",
        ]
        for rpc in sorted(self.calls):
            codes = ", ".join(f"{c} {n}" for c, n in self.codes[rpc].most_common())
            lines.append(
                f"  {rpc:26s} {self.calls[rpc]:6d} calls ({self.raw[rpc]:5d} raw)"
                f" {self.seconds[rpc]:6.1f}s  {codes}"
            )
        for f in self.failures.values():
            lines.append("  BAD " + f.repro().replace("\n", "\n  "))
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "budget_s": budget_s(),
            "fuzz_seconds": round(sum(self.seconds.values()), 2),
            "calls": sum(self.calls.values()),
            "generated_messages": sum(self.calls.values())
            - sum(self.raw.values())
            - sum(self.peer.values()),
            "raw_bodies": sum(self.raw.values()),
            "malicious_owner_pulls": sum(self.peer.values()),
            "per_rpc": {
                rpc: {
                    "calls": self.calls[rpc],
                    "raw": self.raw[rpc],
                    "seconds": round(self.seconds[rpc], 2),
                    "codes": dict(self.codes[rpc]),
                }
                for rpc in sorted(self.calls)
            },
            "bad": [
                {
                    "rpc": f.rpc,
                    "target": f.target,
                    "code": f.code,
                    "details": f.details,
                    "count": f.count,
                    "kind": f.kind,
                    "body_hex": f.body.hex(),
                    "body": describe_body(f.rpc, f.body),
                }
                for f in self.failures.values()
            ],
        }

    def write_report(self) -> None:
        path = os.environ.get(ENV_REPORT, "").strip()
        if path:
            with open(path, "w") as fh:
                json.dump(self.as_json(), fh, indent=1)


STATS = Stats()


# --- shrinking ---------------------------------------------------------------------------------

# Bytes fields that carry a serialized message, shrunk as that message.
NESTED = {"kvxferd.v1.HandshakeRequest.payload": peer_pb2.HandshakePayload}
SHRINK_CALLS = 400


def same_failure(a: Outcome, b: Outcome) -> bool:
    return a.code == b.code and _shape(a.details)[:60] == _shape(b.details)[:60]


def shrink(rpc: Rpc, body: bytes, bad: Outcome, send: Callable[[bytes], Outcome]) -> bytes:
    """A smaller body that still fails like ``bad`` (greedy, at most SHRINK_CALLS calls):
    fields cleared, repeated fields cut, nested payloads shrunk; raw bytes cut."""
    budget = [SHRINK_CALLS]

    def still(candidate: bytes) -> bool:
        if budget[0] <= 0:
            return False
        budget[0] -= 1
        return same_failure(send(candidate), bad)

    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(rpc.input)()
    try:
        msg.ParseFromString(body)
        if msg.SerializeToString() != body:
            raise ValueError("not canonical")  # shrink the bytes, not a re-encoding
    except Exception:
        return _shrink_bytes(body, still)
    root = msg

    def check() -> bool:
        return still(root.SerializeToString())

    _shrink_message(msg, check)
    return root.SerializeToString()


def _shrink_bytes(body: bytes, still: Callable[[bytes], bool]) -> bytes:
    chunk = max(1, len(body) // 2)
    while chunk >= 1:
        i = 0
        while i < len(body):
            candidate = body[:i] + body[i + chunk :]
            if candidate != body and still(candidate):
                body = candidate
            else:
                i += chunk
        chunk //= 2
    return body


def _snapshot(msg: Any, f: Any) -> list[Any]:
    items = getattr(msg, f.name)
    if f.type != f.TYPE_MESSAGE:
        return list(items)
    out = []
    for x in items:
        c = type(x)()
        c.CopyFrom(x)
        out.append(c)
    return out


def _shrink_message(msg: Any, check: Callable[[], bool]) -> None:
    for f in list(msg.DESCRIPTOR.fields):
        if f.is_repeated:
            if not len(getattr(msg, f.name)):
                continue
            saved = _snapshot(msg, f)
            msg.ClearField(f.name)
            if check():
                continue
            _restore(msg, f, saved)
            for i in reversed(range(len(saved))):
                if len(getattr(msg, f.name)) <= 1:
                    break
                snap = _snapshot(msg, f)
                del getattr(msg, f.name)[i]
                if not check():
                    _restore(msg, f, snap)
            if f.type == f.TYPE_MESSAGE:
                for sub in getattr(msg, f.name):
                    _shrink_message(sub, check)
            continue
        if f.type == f.TYPE_MESSAGE:
            if not msg.HasField(f.name):
                continue
            saved_msg = type(getattr(msg, f.name))()
            saved_msg.CopyFrom(getattr(msg, f.name))
            msg.ClearField(f.name)
            if check():
                continue
            getattr(msg, f.name).CopyFrom(saved_msg)
            _shrink_message(getattr(msg, f.name), check)
            continue
        value = getattr(msg, f.name)
        if f.has_presence and not msg.HasField(f.name):
            continue
        if not f.has_presence and value == f.default_value:
            continue
        msg.ClearField(f.name)
        if check():
            continue
        setattr(msg, f.name, value)
        nested = NESTED.get(f.full_name)
        if nested is not None:
            inner = nested()
            try:
                inner.ParseFromString(value)
            except Exception:
                continue
            if inner.SerializeToString() != value:
                continue

            def check_inner(outer: Any = msg, name: str = f.name, inner: Any = inner) -> bool:
                setattr(outer, name, inner.SerializeToString())
                return check()

            _shrink_message(inner, check_inner)
            setattr(msg, f.name, inner.SerializeToString())


def _restore(msg: Any, f: Any, values: list[Any]) -> None:
    msg.ClearField(f.name)
    getattr(msg, f.name).extend(values)


class Caller:
    """Channels to every daemon; one call of raw bytes to one of them."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def channel(self, target: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(target)
            if ch is None:
                ch = grpc.insecure_channel(
                    target,
                    options=(
                        ("grpc.max_send_message_length", 64 << 20),
                        ("grpc.max_receive_message_length", 64 << 20),
                    ),
                )
                self._channels[target] = ch
            return ch

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def call(
        self,
        rpc: Rpc,
        target: str,
        body: bytes,
        timeout_s: float | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Outcome:
        ch = self.channel(target)
        timeout = UNARY_TIMEOUT_S if timeout_s is None else timeout_s
        if not rpc.streaming:
            unary = ch.unary_unary(rpc.path, request_serializer=None, response_deserializer=None)
            try:
                resp = unary(body, timeout=timeout, metadata=metadata)
            except grpc.RpcError as err:
                return _outcome(err)
            return Outcome("OK", body=resp)
        stream = ch.unary_stream(rpc.path, request_serializer=None, response_deserializer=None)
        call = stream(body, timeout=timeout, metadata=metadata)
        cancelled = threading.Event()

        def stop() -> None:
            cancelled.set()
            call.cancel()

        timer = threading.Timer(STREAM_WINDOW_S, stop)
        timer.start()
        n = 0
        try:
            for _ in call:
                n += 1
                if n >= STREAM_MAX_MESSAGES:
                    stop()
                    break
        except grpc.RpcError as err:
            if cancelled.is_set() and err.code() == grpc.StatusCode.CANCELLED:
                return Outcome("OPEN", messages=n)
            return _outcome(err, n)
        finally:
            timer.cancel()
        return Outcome("OPEN" if cancelled.is_set() else "OK", messages=n)


def _outcome(err: grpc.RpcError, messages: int = 0) -> Outcome:
    code = err.code() if isinstance(err, grpc.Call) else None
    details = err.details() if isinstance(err, grpc.Call) else str(err)
    return Outcome(code.name if code else "UNKNOWN", details or "", messages=messages)
