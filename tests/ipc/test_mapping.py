"""Mapping lifecycle (CPU): one open per peer generation, dropped on every change, never under
a running copy, bounded when idle; opens that fail are remembered; regions are bounded."""

from __future__ import annotations

import pytest
import torch

from kvxferd.errors import PeerUnavailable, SpecError
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.publish import IpcPool, IpcRegion
from tests.ipc.fakes import UUID, FakeHost, FakeMapped, handle, ordinal_of


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _export(host: FakeHost, tag: str, sizes: list[int], *, shared: bool = False) -> IpcPool:
    """Regions of ``sizes`` bytes, each its own allocation, or all in one when ``shared``."""
    if shared:
        h = handle(f"{tag}-all")
        host.buffers[h] = torch.zeros(sum(sizes), dtype=torch.uint8)
        offs = [sum(sizes[:i]) for i in range(len(sizes))]
        return IpcPool(tuple(IpcRegion(h, o, n, UUID) for o, n in zip(offs, sizes, strict=True)))
    regions = []
    for i, n in enumerate(sizes):
        h = handle(f"{tag}-{i}")
        host.buffers[h] = torch.zeros(n, dtype=torch.uint8)
        regions.append(IpcRegion(h, 0, n, UUID))
    return IpcPool(tuple(regions))


def _cache(host: FakeHost, clock: Clock | None = None, idle_s: float = 10.0) -> MappingCache:
    return MappingCache(
        device=0, opener=host.open, ordinal_of=ordinal_of, idle_s=idle_s, clock=clock or Clock()
    )


def test_opened_once_per_generation_and_reused() -> None:
    host = FakeHost()
    ipc = _export(host, "a", [64, 64, 32])
    cache = _cache(host)
    m1 = cache.get(("owner", "i1", 1), ipc)
    m2 = cache.get(("owner", "i1", 1), ipc)
    assert m1 is m2 and len(host.opened) == 3
    assert [int(r.numel()) for r in m1.regions] == [64, 64, 32]


def test_regions_of_one_allocation_share_one_mapping() -> None:
    host = FakeHost()
    cache = _cache(host)
    m = cache.get(("owner", "i1", 1), _export(host, "a", [64, 64, 32], shared=True))
    assert len(host.opened) == 1 and len(m.mappings) == 1
    assert [int(r.numel()) for r in m.regions] == [64, 64, 32]


@pytest.mark.parametrize("change", ["generation", "instance"])
def test_a_new_generation_or_instance_drops_the_old_mappings(change: str) -> None:
    host = FakeHost()
    cache = _cache(host)
    old = cache.get(("owner", "i1", 1), _export(host, "a", [64]))
    key = ("owner", "i1", 2) if change == "generation" else ("owner", "i2", 1)
    new = cache.get(key, _export(host, "b", [64]))
    assert old.closed and old.dropped and host.closed == [handle("a-0")]
    assert not new.closed and cache.current("owner") is new
    with pytest.raises(PeerUnavailable, match="dropped"), old.use():
        pass


def test_a_set_dropped_while_a_copy_uses_it_closes_when_the_copy_ends() -> None:
    host = FakeHost()
    cache = _cache(host)
    maps = cache.get(("owner", "i1", 1), _export(host, "a", [64]))
    with maps.use() as regions:
        assert cache.forget("owner", "peer died")
        assert not maps.closed and host.closed == []  # the copy still reads it
        assert int(regions[0].numel()) == 64
        assert cache.open_sets == 1
    assert maps.closed and host.closed == [handle("a-0")] and cache.open_sets == 0


def test_forget_and_close() -> None:
    host = FakeHost()
    cache = _cache(host)
    cache.get(("p1", "i", 1), _export(host, "a", [8]))
    cache.get(("p2", "i", 1), _export(host, "b", [8]))
    assert not cache.forget("nobody", "x")
    assert cache.forget("p1", "link invalidated") and cache.current("p1") is None
    cache.close()
    assert host.open_now == 0 and cache.current("p2") is None


def test_idle_mappings_are_dropped_so_a_silent_restarted_owner_is_not_pinned() -> None:
    host = FakeHost()
    clock = Clock()
    cache = _cache(host, clock, idle_s=10.0)
    maps = cache.get(("owner", "i1", 1), _export(host, "a", [8]))
    clock.t += 9.0
    assert cache.sweep() == []
    cache.get(("owner", "i1", 1), _export(host, "a", [8]))  # used: the idle clock restarts
    clock.t += 9.0
    assert cache.sweep() == []
    with maps.use():
        clock.t += 20.0
        assert cache.sweep() == []  # in use: never dropped under a copy
    assert cache.sweep() == ["owner"] and maps.closed


def test_failed_open_is_remembered_per_generation() -> None:
    host = FakeHost(fail="cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE")
    cache = _cache(host)
    ipc = _export(host, "a", [8])
    with pytest.raises(SpecError, match="INVALID_VALUE"):
        cache.get(("owner", "i1", 1), ipc)
    host.fail = ""
    assert cache.failure(("owner", "i1", 1)) is not None
    with pytest.raises(SpecError):
        cache.get(("owner", "i1", 1), ipc)  # not retried for this generation
    assert cache.get(("owner", "i1", 2), ipc) is not None  # the next generation tries again


def test_partial_open_failure_closes_what_was_opened() -> None:
    host = FakeHost()
    ipc = _export(host, "a", [8, 8])
    del host.buffers[handle("a-1")]  # the second handle cannot be opened
    with pytest.raises(SpecError, match="MAP_FAILED"):
        _cache(host).get(("owner", "i1", 1), ipc)
    assert host.opened == [handle("a-0")] and host.closed == [handle("a-0")]


def test_a_region_past_its_allocation_is_refused() -> None:
    host = FakeHost()
    h = handle("small")
    host.buffers[h] = torch.zeros(100, dtype=torch.uint8)
    ipc = IpcPool((IpcRegion(h, 40, 64, UUID),))
    with pytest.raises(SpecError, match="runs past its CUDA allocation of 100 bytes"):
        _cache(host).get(("owner", "i1", 1), ipc)
    assert host.open_now == 0


def test_a_gpu_not_visible_here_is_refused() -> None:
    host = FakeHost()
    ipc = _export(host, "a", [8])
    other = IpcPool(tuple(IpcRegion(r.handle, 0, 8, "GPU-ffff") for r in ipc.regions))
    with pytest.raises(SpecError, match="not visible"):
        _cache(host).get(("owner", "i1", 1), other)
    assert host.opened == []


def test_an_allocation_whose_size_could_not_be_read_is_refused() -> None:
    """An open whose size cuMemGetAddressRange could not tell (IpcMapping.size 0) leaves no
    bound to check a region against: refused, and what was opened is closed."""

    class Sizeless(FakeHost):
        def open(self, h: bytes, device: int) -> FakeMapped:
            m = super().open(h, device)
            return Sizeless.Mapped(m.host, m.name, m.buf)

        class Mapped(FakeMapped):
            @property
            def size(self) -> int:
                return 0

    host = Sizeless()
    ipc = _export(host, "sizeless", [4096])
    with pytest.raises(SpecError, match="could not be read"):
        _cache(host).get(("owner", "i1", 1), ipc)
    assert host.open_now == 0
