"""Hypothesis strategies built from protobuf descriptors, plus raw-body mutators.

:func:`messages` walks a message's ``DESCRIPTOR`` and draws every field from a strategy for
its wire type, biased to the values that break code: 0, 1, -1, 2^31, 2^32, 2^63, 2^64-1 and the
type's limits for integers, unknown enum numbers, empty / long / control-character strings,
arbitrary bytes, nested messages to a bounded depth, repeated fields from empty to long, and
oneofs (one member or none). ``hints`` maps a field's full name (``"kvxferd.v1.BlockIds.ids"``)
to a domain strategy (held request IDs, live addresses, in-range block IDs) that is mixed in
with the generic one, so that the fuzz also gets past the first validation of each RPC.

:func:`mutated` takes valid messages and perturbs a few fields the same way; :func:`raw_bodies`
draws request bodies that need not decode at all (random bytes, damaged encodings of valid
messages, wire-type confusion, overlong varints, invalid UTF-8 in string fields, deep nesting).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from google.protobuf import descriptor as _d
from google.protobuf.message import Message
from hypothesis import strategies as st

FD = _d.FieldDescriptor

I32 = (0, 1, -1, 2**31 - 1, -(2**31), 2**15, -(2**15))
I64 = (*I32, 2**31, 2**32, 2**32 - 1, 2**53 + 1, 2**63 - 1, -(2**63), -(2**31) - 1)
U32 = (0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1)
U64 = (*U32, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1)

_INT_RANGES: dict[int, tuple[int, int, tuple[int, ...]]] = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1, I32),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1, I32),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1, I32),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1, I64),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1, I64),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1, I64),
    FD.TYPE_UINT32: (0, 2**32 - 1, U32),
    FD.TYPE_FIXED32: (0, 2**32 - 1, U32),
    FD.TYPE_UINT64: (0, 2**64 - 1, U64),
    FD.TYPE_FIXED64: (0, 2**64 - 1, U64),
}

# Text a proto string can carry (any Unicode scalar value, no lone surrogates).
_CHARS = st.characters(exclude_categories=("Cs",))
_NASTY_TEXT = (
    "",
    " ",
    "\x00",
    "a\nb",
    "\r\n\t\x1b[31m",
    "\u202e\u200b\ufeff",
    "%s%n%x",
    "../../etc/passwd",
    "'; DROP TABLE x; --",
    "\U0001f600" * 3,
    "x" * 4096,
)


def ints(field_type: int) -> st.SearchStrategy[int]:
    lo, hi, edges = _INT_RANGES[field_type]
    return st.one_of(
        st.sampled_from(edges),
        st.integers(-3, 70).filter(lambda v: lo <= v <= hi),
        st.integers(lo, hi),
    )


def texts() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(_NASTY_TEXT),
        st.text(_CHARS, max_size=40),
        st.text(st.characters(max_codepoint=0x1F), max_size=20),  # control characters
        _long(st.text(_CHARS, min_size=1, max_size=8), 300, 5000),
    )


def _long(piece: st.SearchStrategy[Any], lo: int, hi: int) -> st.SearchStrategy[Any]:
    """A long value made of one short drawn piece repeated (cheap for Hypothesis to draw,
    where drawing thousands of independent elements would overrun its buffer)."""
    return st.builds(lambda p, n: (p * (n // max(1, len(p)) + 1))[:n], piece, st.integers(lo, hi))


def blobs() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(b""),
        st.binary(max_size=64),
        _long(st.binary(min_size=1, max_size=16), 1000, 20_000),
    )


def _enum_values(field: FD) -> st.SearchStrategy[int]:
    known = [v.number for v in field.enum_type.values]
    # proto3 enums are open: unknown numbers travel as themselves.
    return st.one_of(st.sampled_from(known), st.sampled_from((-1, max(known) + 1, 99, 2**31 - 1)))


Hints = Mapping[str, st.SearchStrategy[Any]]


def _hint(field: FD, hints: Hints) -> st.SearchStrategy[Any] | None:
    """The domain strategy for ``field``: by full name, else by short name."""
    return hints.get(field.full_name, hints.get(field.name))


def _scalar(field: FD, hints: Hints, depth: int) -> st.SearchStrategy[Any]:
    key = ("scalar", field.full_name, depth, id(hints))
    if key not in _FIELD_CACHE:
        _FIELD_CACHE[key] = _build_scalar(field, hints, depth)
    return _FIELD_CACHE[key]


def _build_scalar(field: FD, hints: Hints, depth: int) -> st.SearchStrategy[Any]:
    hint = _hint(field, hints)
    if field.type == FD.TYPE_MESSAGE:
        base: st.SearchStrategy[Any] = messages(field.message_type, hints, depth + 1)
    elif field.type in _INT_RANGES:
        base = ints(field.type)
    elif field.type == FD.TYPE_BOOL:
        base = st.booleans()
    elif field.type == FD.TYPE_ENUM:
        base = _enum_values(field)
    elif field.type == FD.TYPE_STRING:
        base = texts()
    elif field.type == FD.TYPE_BYTES:
        base = blobs()
    elif field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        base = st.floats(
            allow_nan=True, allow_infinity=True, width=64 if field.type == FD.TYPE_DOUBLE else 32
        )
    else:  # pragma: no cover - groups do not exist in proto3
        raise TypeError(f"unsupported field type {field.type} of {field.full_name}")
    return base if hint is None else st.one_of(hint, base)


def _repeated(field: FD, hints: Hints, depth: int) -> st.SearchStrategy[list[Any]]:
    key = ("repeated", field.full_name, depth, id(hints))
    if key not in _FIELD_CACHE:
        _FIELD_CACHE[key] = _build_repeated(field, hints, depth)
    return _FIELD_CACHE[key]


def _build_repeated(field: FD, hints: Hints, depth: int) -> st.SearchStrategy[list[Any]]:
    hint = _hint(field, hints)
    elem = _scalar_no_hint(field, hints, depth)
    sizes = st.one_of(
        st.lists(elem, max_size=4),
        st.lists(elem, max_size=8 if field.type == FD.TYPE_MESSAGE else 40),
    )
    if field.type not in (FD.TYPE_MESSAGE, FD.TYPE_STRING, FD.TYPE_BYTES) and depth < 2:
        sizes = st.one_of(sizes, _long(st.lists(elem, min_size=1, max_size=4), 500, 5000))
    return sizes if hint is None else st.one_of(hint, sizes)


def _scalar_no_hint(field: FD, hints: Hints, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type, hints, depth + 1)
    return _scalar(field, {}, depth)


MAX_DEPTH = 4


def messages(
    descriptor: _d.Descriptor, hints: Hints | None = None, depth: int = 0
) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type; every field set or not, each from its strategy."""
    hints = hints or {}
    key = (descriptor.full_name, depth, id(hints))
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    cls = _class(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    oneof_fields = {f.name for o in descriptor.oneofs for f in o.fields}
    plain = [
        (f, _repeated(f, hints, depth) if f.is_repeated else _scalar(f, hints, depth))
        for f in descriptor.fields
        if f.name not in oneof_fields
    ]
    oneofs = [
        st.one_of(st.none(), *(st.tuples(st.just(f), _scalar(f, hints, depth)) for f in o.fields))
        for o in descriptor.oneofs
    ]

    @st.composite
    def draw(data: st.DrawFn) -> Message:
        msg = cls()
        for f, strategy in plain:
            if data(st.booleans()):
                _set(msg, f, data(strategy))
        for strategy in oneofs:
            chosen = data(strategy)
            if chosen is not None:
                _set(msg, *chosen)
        return msg

    out = draw()
    _CACHE[key] = out
    # Keep the hints alive while their id() is a cache key.
    _KEEP.append(hints)
    return out


_CACHE: dict[tuple[str, int, int], st.SearchStrategy[Message]] = {}
_FIELD_CACHE: dict[tuple[str, str, int, int], st.SearchStrategy[Any]] = {}
_KEEP: list[Hints] = []


def _set(msg: Message, f: FD, value: Any) -> None:
    if f.is_repeated:
        getattr(msg, f.name).extend(value)
    elif f.type == FD.TYPE_MESSAGE:
        getattr(msg, f.name).CopyFrom(value)
    else:
        setattr(msg, f.name, value)


def _class(descriptor: _d.Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


# --- mutations of valid messages -----------------------------------------------------------


def mutated(
    bases: Callable[[], Sequence[Message]], hints: Hints | None = None
) -> st.SearchStrategy[Message]:
    """One of ``bases()`` (called at draw time: bases may change while fuzzing) with some
    fields, at any depth, replaced by generic values, cleared, damaged (bytes) or with list
    elements dropped. The mutation rate is drawn per message (about 1 field in 3, 10 or 50),
    so that some requests fail the first check and others get deep."""
    hints = hints or {}

    @st.composite
    def draw(data: st.DrawFn) -> Message:
        options = list(bases())
        base = data(st.sampled_from(options))
        msg = type(base)()
        msg.CopyFrom(base)
        rate = data(st.sampled_from((3, 10, 50)))
        _mutate(msg, data, hints, 0, rate)
        return msg

    return draw()


def _mutate(msg: Message, data: st.DrawFn, hints: Hints, depth: int, rate: int) -> None:
    for f in msg.DESCRIPTOR.fields:
        if f.type == FD.TYPE_MESSAGE and data(st.integers(0, 3)):
            # Recurse into set sub-messages (most of the time: that is where the values are).
            if f.is_repeated:
                for sub in getattr(msg, f.name):
                    _mutate(sub, data, hints, depth + 1, rate)
            elif msg.HasField(f.name):
                _mutate(getattr(msg, f.name), data, hints, depth + 1, rate)
            continue
        if data(st.integers(0, rate - 1)):
            continue  # this field stays as it is
        how = data(st.integers(0, 3))
        if how == 0:
            msg.ClearField(f.name)
        elif how == 1 and f.is_repeated and len(getattr(msg, f.name)):
            items = getattr(msg, f.name)
            del items[data(st.integers(0, len(items) - 1))]
        elif how == 2 and f.type == FD.TYPE_BYTES and not f.is_repeated:
            setattr(msg, f.name, data(damaged(getattr(msg, f.name))))
        else:
            msg.ClearField(f.name)
            if f.is_repeated:
                _set(msg, f, data(_repeated(f, hints, depth + 1)))
            else:
                _set(msg, f, data(_scalar(f, hints, depth + 1)))


# --- raw bodies ------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def crafted(descriptor: _d.Descriptor) -> st.SearchStrategy[bytes]:
    """Hand-shaped bodies that a protobuf parser must refuse (or read in an odd way)."""
    numbers = [f.number for f in descriptor.fields] or [1]
    strings = [f.number for f in descriptor.fields if f.type == FD.TYPE_STRING] or [1]
    num = st.sampled_from(numbers)
    return st.one_of(
        # A string field holding invalid UTF-8.
        st.builds(
            lambda n, junk: _tag(n, 2) + _varint(len(junk)) + junk,
            st.sampled_from(strings),
            st.sampled_from(
                [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"a\x80b", b"\xf8\x88\x80\x80"]
            ),
        ),
        # Every wire type on a known field number (confusion), including groups (3, 4) and 6, 7.
        st.builds(
            lambda n, w, tail: _tag(n, w) + tail, num, st.integers(0, 7), st.binary(max_size=12)
        ),
        # A length prefix longer than the body.
        st.builds(
            lambda n, ln, tail: _tag(n, 2) + _varint(ln) + tail,
            num,
            st.sampled_from([1, 127, 2**31, 2**32 - 1, 2**63, 2**64 - 1]),
            st.binary(max_size=8),
        ),
        # Overlong and truncated varints.
        st.builds(lambda n, k: _tag(n, 0) + b"\xff" * k, num, st.integers(1, 20)),
        st.builds(lambda n, k: _tag(n, 0) + b"\x80" * k + b"\x00", num, st.integers(9, 15)),
        # Field number 0 and the largest field numbers.
        st.builds(
            lambda n, v: _tag(n, 0) + _varint(v),
            st.sampled_from([0, 2**29 - 1, 19000, 19999, 2**32 - 1]),
            st.integers(0, 2**64 - 1),
        ),
        # Deeply nested length-delimited fields (parsers cap recursion at ~100).
        st.builds(_nested, num, st.integers(50, 200)),
        # Packed fields with a ragged end.
        st.builds(
            lambda n, body: _tag(n, 2) + _varint(len(body)) + body,
            num,
            st.binary(min_size=1, max_size=30).map(lambda b: b + b"\x80"),
        ),
    )


def _nested(number: int, depth: int) -> bytes:
    body = b""
    for _ in range(depth):
        body = _tag(number, 2) + _varint(len(body)) + body
    return body


def damaged(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` with bytes flipped, cut, inserted, repeated or with garbage appended."""
    if not valid:
        return st.binary(max_size=16)
    n = len(valid)
    return st.one_of(
        st.builds(
            lambda i, x: valid[:i] + bytes([valid[i] ^ x]) + valid[i + 1 :],
            st.integers(0, n - 1),
            st.integers(1, 255),
        ),
        st.builds(lambda i: valid[:i], st.integers(0, n - 1)),
        st.builds(
            lambda i, junk: valid[:i] + junk + valid[i:],
            st.integers(0, n),
            st.binary(max_size=16),
        ),
        st.builds(lambda k: valid * k, st.integers(2, 5)),
        st.builds(lambda junk: valid + junk, st.binary(min_size=1, max_size=32)),
        st.builds(lambda i, j: valid[:i] + valid[j:], st.integers(0, n), st.integers(0, n)),
    )


def raw_bodies(
    descriptor: _d.Descriptor, valid: Callable[[], Sequence[bytes]]
) -> st.SearchStrategy[bytes]:
    """Request bodies for an RPC taking ``descriptor``: random, crafted, or damaged valid."""

    @st.composite
    def from_valid(data: st.DrawFn) -> bytes:
        return data(damaged(data(st.sampled_from(list(valid())))))

    return st.one_of(
        st.binary(max_size=64),
        _long(st.binary(min_size=1, max_size=64), 64, 4096),
        crafted(descriptor),
        from_valid(),
    )
