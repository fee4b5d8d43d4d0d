"""An OWNED pool larger than the room left in /dev/shm is refused at Attach.

Before: the daemon created its segments sparse, so an Attach of 200 TB on a 24 GB /dev/shm
succeeded, and the first write past the room (a pull into the pool, or the engine computing
into it) would have killed the process with SIGBUS. Now the pool's size is checked against
/dev/shm's free space first, and each segment's pages are reserved when it is created
(kvxferd/attach/shm.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvxferd.attach.shm import SHM_DIR, ShmSegment, check_shm_room
from kvxferd.engine import EngineClient
from kvxferd.errors import ResourceExhausted
from kvxferd.scenario.daemons import DaemonOptions
from tests.service.conftest import Daemons, launch

BLOCK = 2 * 8 * 128 * 16 * 2  # dense's K and V of one block of one layer, bytes
SMALL = "dense:num_blocks=4,num_layers=2"


def _free() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def test_more_than_the_free_room_is_refused_and_a_segment_is_reserved() -> None:
    with pytest.raises(ResourceExhausted) as err:
        check_shm_room(_free() + (1 << 30))
    assert "/dev/shm" in err.value.message and "enlarge /dev/shm" in err.value.fix
    seg = ShmSegment.create(f"/kvxferd-room-test-{os.getpid()}", 1 << 20)
    try:  # reserved: its pages are allocated in /dev/shm, not left sparse
        assert os.stat(SHM_DIR / seg.name.removeprefix("/")).st_blocks * 512 >= 1 << 20
    finally:
        seg.release()
        seg.unlink()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("shm-room"),
        DaemonOptions("att", SMALL, extra=("--set", "pool.mode=attached")),
    )
    yield ds
    ds.stop()


def test_an_owned_attach_larger_than_dev_shm_is_refused_and_the_daemon_serves_on(
    daemon: Daemons,
) -> None:
    blocks = _free() // BLOCK + 1024
    client = EngineClient(daemon["att"].engine_socket, timeout_s=30)
    try:
        with pytest.raises(Exception) as err:
            client.attach(f"dense:num_blocks={blocks},num_layers=1", "owned")
        text = str(err.value)
        assert "RESOURCE_EXHAUSTED" in text and "enlarge /dev/shm" in text, text
        att = client.attach(SMALL, "owned")  # what fits still attaches
        att.detach()
    finally:
        client.close()
    assert daemon["att"].alive()  # type: ignore[operator]
