"""The frame splitter of the Unix-socket channels (kvxferd/wire/splitter.py, FrameSplitter): the
frames of a byte stream come out whole and in order however the stream is cut into reads, and
a header announcing more than MAX_FRAME bytes is refused once reached."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.wire.local import frame
from kvxferd.wire.splitter import HEADER, MAX_FRAME, FrameError, FrameSplitter

frames_st = st.lists(
    st.tuples(st.integers(0, 0xFFFFFFFF), st.integers(0, 255), st.binary(min_size=0, max_size=300)),
    max_size=12,
)


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=300, deadline=None)
@given(frames=frames_st, cuts=st.lists(st.integers(0, 10_000), max_size=20))
def test_any_cut_of_the_stream_gives_back_the_same_frames(
    frames: list[tuple[int, int, bytes]], cuts: list[int]
) -> None:
    data = b"".join(frame(cid, kind, body) for cid, kind, body in frames)
    splitter = FrameSplitter()
    out = [f for piece in _cut(data, cuts) for f in splitter.feed(piece)]
    assert out == frames
    assert list(splitter.feed(b"")) == []  # nothing left over


def test_a_partial_frame_waits_for_the_rest() -> None:
    splitter = FrameSplitter()
    data = frame(7, 1, b"hello")
    assert list(splitter.feed(data[:3])) == []
    assert list(splitter.feed(data[3:-1])) == []
    assert list(splitter.feed(data[-1:])) == [(7, 1, b"hello")]


def test_an_oversized_header_is_refused_after_the_frames_before_it() -> None:
    splitter = FrameSplitter()
    bad = HEADER.pack(MAX_FRAME + 1, 9, 1)
    got = []
    with pytest.raises(FrameError, match="over the"):
        for f in splitter.feed(frame(1, 1, b"ok") + bad):
            got.append(f)
    assert got == [(1, 1, b"ok")]


def test_a_frame_of_exactly_max_frame_is_allowed() -> None:
    splitter = FrameSplitter()
    header = HEADER.pack(MAX_FRAME, 3, 2)
    assert list(splitter.feed(header)) == []  # accepted, waiting for its body
