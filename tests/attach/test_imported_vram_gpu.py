"""GPU: engine-attached IMPORTED VRAM, served by same-host KERNEL pulls (issue 13). Skipped
without CUDA; the device run executes them.

An engine process (tests/attach/engine_proc.py) allocates its own KV tensors on cuda:0,
attaches them IMPORTED to an attached daemon, stamps every block and holds; decode daemons on
the same GPU pull with KERNEL, and Checksum digests of both sides must agree (dense, hybrid,
MLA). The owner registers nothing with NIXL: a reader with transfer.cuda_ipc = false is refused
at StartPull with the reason and the fix. Detach and engine death close the daemon's mapping of
the engine's memory (its log says so), and a re-attached engine is served again, readers
mapping the new generation's handles and dropping the old. A daemon whose own pool is imported
VRAM reads with KERNEL too.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import engine_pb2, scheduler_pb2
from kvxferd.wire.codec import group_ids_to_proto
from tests.attach.test_attach import Engine, _sched, _state
from tests.service.conftest import Daemon, Daemons, launch
from tests.service.test_service_staged import Client

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

Ids = Callable[[random.Random], list[list[int]]]
PRESETS: dict[str, tuple[str, Ids, str]] = {
    "dense": ("dense:num_blocks=64", lambda r: [r.sample(range(64), 24)], "0,1"),
    "hybrid": (
        "hybrid:num_blocks=16,ppl=4",
        lambda r: [r.sample(range(16), 6), r.sample(range(16), 6)],
        "0;0",
    ),
    "mla": ("mla:num_blocks=64,num_layers=8", lambda r: [r.sample(range(64), 20)], "0,1"),
}
DENSE = PRESETS["dense"][0]
IMPORTED = ("--mode", "imported", "--device", "cuda:0")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    attached = ("--set", "pool.mode=attached")
    ds = launch(
        tmp_path_factory.mktemp("imported-vram"),
        DaemonOptions("att", DENSE, device="cuda:0", extra=attached),
        DaemonOptions("att2", DENSE, device="cuda:0", extra=attached),
        *(DaemonOptions(f"decode-{n}", p[0], device="cuda:0") for n, p in PRESETS.items()),
        DaemonOptions(
            "nokernel", DENSE, device="cuda:0", extra=("--set", "transfer.cuda_ipc=false")
        ),
    )
    yield ds
    ds.stop()


def _records(d: Daemon, msg: str) -> list[dict[str, object]]:
    """The daemon's JSON log records whose message is ``msg``."""
    out = []
    for line in Path(d.log).read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("msg") == msg:
            out.append(rec)
    return out


def _log(d: Daemon, msg: str) -> int:
    return len(_records(d, msg))


def _eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _dropped(d: Daemon, generation: int) -> bool:
    """Has reader ``d`` dropped its mappings of the owner's ``generation``?"""
    return any(r.get("generation") == generation for r in _records(d, "cuda ipc mappings dropped"))


def _kernel_pull(owner: Daemon, reader: Daemon, name: str, seed: int, ids: Ids) -> None:
    """Hold random blocks on ``owner``, pull them into ``reader``: KERNEL, bytes equal."""

    async def go() -> None:
        c = Client(owner, reader)
        rng = random.Random(seed)
        remote, local = ids(rng), ids(rng)
        st = await c.pull(await c.hold(f"imp-{name}-{seed}", remote), local)
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_KERNEL, st.strategy_reason
        assert await c.same(remote, local)

    asyncio.run(go())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_imported_vram_is_pulled_with_kernel_byte_exact(daemons: Daemons, name: str) -> None:
    text, ids, hold = PRESETS[name]
    att = daemons["att"]
    eng = Engine(att.engine_socket, *IMPORTED, "--preset", text, "--blocks", hold, "--seed", "21")
    try:
        eng.line(timeout_s=180)
        pool = _state(att)
        assert pool.state == engine_pb2.REGISTRATION_STATE_REGISTERED
        assert pool.memory_mode == engine_pb2.MEMORY_MODE_IMPORTED
        assert not pool.exports  # the engine allocated: nothing for it to map
        _kernel_pull(att, daemons[f"decode-{name}"], name, 7, ids)
        eng.detach()
    finally:
        eng.kill()


def test_regions_carved_from_one_allocation_are_found_at_their_offsets(daemons: Daemons) -> None:
    """One CUDA IPC handle for every region, each region 4 KiB or more into it: the daemon
    opens it once, the reader maps it once, and every region's bytes are where they should be."""
    att, decode = daemons["att"], daemons["decode-dense"]
    opened = _log(att, "CUDA IPC memory opened")
    eng = Engine(att.engine_socket, *IMPORTED, "--preset", DENSE, "--carve", "--seed", "23")
    try:
        eng.line(timeout_s=180)
        assert _log(att, "CUDA IPC memory opened") == opened + 1
        _kernel_pull(att, decode, "carved", 8, PRESETS["dense"][1])
        assert _records(decode, "cuda ipc mappings opened")[-1]["allocations"] == 1
        eng.detach()
    finally:
        eng.kill()


def test_a_reader_without_kernel_is_refused_with_the_fix(daemons: Daemons) -> None:
    att, nokernel = daemons["att"], daemons["nokernel"]
    eng = Engine(att.engine_socket, *IMPORTED, "--preset", DENSE, "--request", "nok")
    try:
        ticket = eng.line(timeout_s=180)["ticket"]
        with pytest.raises(grpc.RpcError) as ei:
            _sched(nokernel.grpc).StartPull(
                scheduler_pb2.StartPullRequest(
                    request_id=ticket["request_id"],
                    peer_address=ticket["peer_address"],
                    remote_block_ids=group_ids_to_proto(ticket["remote_block_ids"]),
                    local_block_ids=group_ids_to_proto([[10, 11, 12, 13]]),
                    deadline_ms=20_000,
                )
            )
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        text = ei.value.details() or ""
        assert "serves its pool with KERNEL pulls only" in text, text
        assert "this daemon's transfer.cuda_ipc = false" in text
        assert "mode='owned'" in text
        eng.detach()
    finally:
        eng.kill()


def test_detach_and_engine_death_drop_the_mappings_and_a_new_engine_is_served(
    daemons: Daemons,
) -> None:
    att, decode = daemons["att"], daemons["decode-dense"]
    ids = PRESETS["dense"][1]

    def closed() -> int:
        return _log(att, "CUDA IPC memory closed")

    eng = Engine(att.engine_socket, *IMPORTED, "--preset", DENSE, "--seed", "31")
    try:
        first = eng.line(timeout_s=180)
        _kernel_pull(att, decode, "life-1", 1, ids)
        before = closed()
        eng.detach()  # 1. detach: the daemon's mapping of the engine's memory is closed
        assert closed() > before  # before Detach answered
        eng = Engine(att.engine_socket, *IMPORTED, "--preset", DENSE, "--seed", "32")
        second = eng.line(timeout_s=180)
        assert second["generation"] > first["generation"]
        _kernel_pull(att, decode, "life-2", 2, ids)  # the reader maps the new handles ...
        assert _dropped(decode, first["generation"])  # ... and no longer the old ones
        before = closed()
        eng.kill()  # 2. engine death: the same, through the end of its session
        assert _eventually(lambda: closed() > before), "the daemon kept the dead engine mapped"
        assert _state(att).state == engine_pb2.REGISTRATION_STATE_DETACHED
        eng = Engine(att.engine_socket, *IMPORTED, "--preset", DENSE, "--seed", "33")
        eng.line(timeout_s=180)
        _kernel_pull(att, decode, "life-3", 3, ids)
        assert _dropped(decode, second["generation"])
        eng.detach()
    finally:
        eng.kill()
    assert _log(att, "imported CUDA mappings still referenced") == 0
    assert att.alive()  # type: ignore[operator]


def test_a_daemon_whose_pool_is_imported_vram_reads_with_kernel(daemons: Daemons) -> None:
    att, att2 = daemons["att"], daemons["att2"]
    owner = Engine(att.engine_socket, *IMPORTED, "--preset", DENSE, "--seed", "41")
    reader = Engine(att2.engine_socket, *IMPORTED, "--preset", DENSE, "--seed", "42")
    try:
        owner.line(timeout_s=180)
        reader.line(timeout_s=180)
        _kernel_pull(att, att2, "into-imported", 4, PRESETS["dense"][1])
        owner.detach()
        reader.detach()
    finally:
        owner.kill()
        reader.kill()
