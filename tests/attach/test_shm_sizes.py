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


@pytest.mark.parametrize("kind", ["symlink to a file", "directory", "symlink loop"])
def test_a_name_that_is_not_a_segment_is_refused_naming_shm_name(
    kind: str, tmp_path: object
) -> None:
    # An engine's IMPORTED handle names a segment in /dev/shm. A symlink there once made the
    # daemon map (and register with NIXL) whatever regular file it pointed at; a directory or
    # a symlink loop was an INTERNAL error (a helper's hostile-input review).
    from pathlib import Path

    from kvxferd.errors import SpecError

    name = f"kvxferd-test-{uuid.uuid4().hex[:12]}"
    path = shm_path(name)
    victim = Path(str(tmp_path)) / "victim"
    victim.write_bytes(b"\0" * 4096)
    if kind == "symlink to a file":
        path.symlink_to(victim)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(path)
    try:
        with pytest.raises(SpecError) as err:
            ShmSegment.open(name)
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    assert err.value.field == "shm_name" and "not a shared-memory segment" in err.value.message
    assert "shm_open" in err.value.fix
