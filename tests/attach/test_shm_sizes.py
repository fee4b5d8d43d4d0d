"""kvxferd/attach/shm.py: a segment too big for the host is refused as ResourceExhausted, with
nothing left behind, however big the size (past what a file offset holds, too): an Attach of
such a pool is a clear refusal, not an internal error."""

from __future__ import annotations

import uuid

import pytest

from kvxferd.attach.shm import ShmSegment, shm_path
from kvxferd.errors import ResourceExhausted


@pytest.mark.parametrize("size", [1 << 62, (1 << 63) - 1, 1 << 63, 1 << 70])
def test_a_segment_the_host_cannot_hold_is_refused_and_removed(size: int) -> None:
    name = f"kvxferd-test-{uuid.uuid4().hex[:12]}"
    with pytest.raises(ResourceExhausted, match="cannot create"):
        ShmSegment.create(name, size)
    assert not shm_path(name).exists()
