"""An Attach that fails part-way lets go of every shared-memory mapping it made (each holds an
open descriptor: kvxferd/attach/shm.py), and running out of descriptors is refused naming the
open-files limit, not /dev/shm.

Before: a failed OWNED Attach of many regions kept the descriptors of the segments it had
created (the failure's traceback kept their tensors), so every later Attach failed with EMFILE,
under a fix that said to enlarge /dev/shm. Here a real daemon's open-files limit is lowered
(prlimit) so that an Attach runs out of descriptors after some regions were mapped."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import pytest

from kvxferd.engine import EngineClient, shared_tensors
from kvxferd.engine.shared import find_shared, forget_shared
from kvxferd.layout.presets import preset
from kvxferd.scenario.daemons import DaemonOptions
from tests.service.conftest import Daemons, launch

MANY = "dense:num_blocks=1,num_layers=160"  # 64 KiB a region, one descriptor each
SPARE = 48  # descriptors the daemon may open past those it holds when idle
SMALL = "dense:num_blocks=4,num_layers=2"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemons, int]]:
    ds = launch(
        tmp_path_factory.mktemp("fd-leak"),
        DaemonOptions("att", SMALL, extra=("--set", "pool.mode=attached")),
    )
    ready = ds.set["att"].ready
    assert ready is not None
    yield ds, ready.pid
    ds.stop()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("mode", ["owned", "imported"])
def test_an_attach_out_of_descriptors_closes_what_it_mapped_and_names_the_limit(
    daemon: tuple[Daemons, int], mode: str
) -> None:
    ds, pid = daemon
    client = EngineClient(ds["att"].engine_socket, timeout_s=30)
    tensors = shared_tensors(preset(MANY)) if mode == "imported" else None
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        client.describe()  # the client's connection is open before counting
        before = _fds(pid)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (before + SPARE, hard))
        with pytest.raises(Exception) as err:
            client.attach(MANY, mode, tensors=tensors)  # type: ignore[arg-type]
        text = str(err.value)
        assert "RESOURCE_EXHAUSTED" in text and "open-files limit" in text, text
        assert "LimitNOFILE" in text and "/dev/shm" not in text.partition("fix:")[2], text
        leaked = _fds(pid) - before
        assert leaked <= 2, f"{leaked} descriptors left open by the failed Attach"
        # Under the same limit, the next Attach that fits goes through.
        att = client.attach(SMALL, "owned")
        att.detach()
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        client.close()
        if tensors is not None:
            forget_shared([find_shared(t, name)[0] for name, t in tensors.items()])
    assert ds["att"].alive()  # type: ignore[operator]
