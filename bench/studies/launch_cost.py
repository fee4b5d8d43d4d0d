"""What a KERNEL pull's launch costs on the host, part by part, on one GPU (session 16): the
copy through ``kvxferd.kernels.run_copy`` (a ready 16-run group over 64 regions, the table
travelling with the launch), the op called directly, the extension's binding
(``cuda/bindings.cpp``), a CPU-only op of the same extension (the dispatcher's share), and the
completion event (fresh, or reused). p50 of 2,000 calls each, synchronised between calls, as a
pull launches on an idle stream. Then again in the conditions of a daemon: the CPU caches
cooled between calls (a 16-block plan and a 64 MiB array walked, as a pull's other work does),
and a NIXL agent running beside it (its progress thread, every 100 us, with the pool's VRAM
registered: UCX's CUDA transports are live).

    python -m bench.studies.launch_cost
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvxferd.kernels import GroupCopy, active_backend, prepare_copy, run_copy


def _time(name: str, fn: Callable[[], object], between: Callable[[], None] | None = None) -> None:
    times = []
    for i in range(2100):
        if between is not None:
            between()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= 100:
            times.append(t1 - t0)
    print(f"{name:40s} p50 {statistics.median(times) * 1e6:7.1f} us")


def main() -> int:
    print(active_backend().describe())
    regions, block, blocks = 64, 64 << 10, 64
    dst = [torch.zeros(block * blocks, dtype=torch.uint8, device="cuda") for _ in range(regions)]
    src = [torch.ones(block * blocks, dtype=torch.uint8, device="cuda") for _ in range(regions)]
    rng = np.random.default_rng(0)
    lo = rng.choice(blocks, 16, replace=False).astype(np.int64) * block
    ro = rng.choice(blocks, 16, replace=False).astype(np.int64) * block
    g = GroupCopy(np.arange(regions, dtype=np.int64), lo, ro, np.full(16, block, dtype=np.int64))
    ready = prepare_copy(dst, src, [g])
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    s = stream.cuda_stream
    table, like = ready.tables[0], dst[0]
    op = torch.ops.kvxferd.copy_group.default
    width = torch.ops.kvxferd.copy_vector_width.default
    flat = torch.zeros((16, 3), dtype=torch.int64)
    flat[:, 2] = 16
    spare = torch.cuda.Event()  # type: ignore[no-untyped-call]
    spare.record(stream)

    def fresh_event() -> None:
        torch.cuda.Event().record(stream)  # type: ignore[no-untyped-call]

    cases = {
        "run_copy (ready copy)": lambda: run_copy(ready, max_ctas=64, stream=s),
        "op .default, direct": lambda: op(table, 16, regions, like, 64, s),
        "CPU-only op (copy_vector_width)": lambda: width(flat),
        "fresh event, record": fresh_event,
        "reused event, record": lambda: spare.record(stream),
    }
    for name, fn in cases.items():
        _time(name, fn)
    from kvxferd.blocks import plan_pull
    from kvxferd.layout.presets import preset

    spec = preset("dense:num_blocks=600")
    junk = np.ones(8 << 20, dtype=np.int64)  # 64 MiB

    def cool() -> None:
        ids = [rng.choice(600, 16, replace=False)]
        plan_pull(spec, spec, ids, [rng.choice(600, 16, replace=False)], prefix_caching=True)
        int(junk.sum())

    def direct() -> None:
        op(table, 16, regions, like, 64, s)

    _time("op .default, caches cooled between", direct, between=cool)
    from kvxferd.kernels.loader import cuda_module

    raw = cuda_module().copy_group_raw
    at, numel = table.data_ptr(), table.numel()

    def binding() -> None:
        raw(at, numel, 16, regions, 0, 64, s)

    _time("binding (cuda/bindings.cpp)", binding)
    _time("binding, caches cooled between", binding, between=cool)
    _time("CPU-only op, caches cooled between", lambda: width(flat), between=cool)

    def warmed() -> None:
        cool()
        width(flat)  # the dispatcher's path walked just before

    _time("op .default, cooled, dispatcher warmed", direct, between=warmed)
    from kvxferd.nixl import MemType, NixlAgent

    agent = NixlAgent("launch-cost", cuda_device=0)
    agent.start()
    rows = np.array([[t.data_ptr(), t.numel(), 0] for t in dst], dtype=np.int64)
    agent.register(rows, MemType.VRAM)
    _time("op .default, NIXL agent running", direct)
    _time("op .default, NIXL agent, caches cooled", direct, between=cool)
    agent.close()
    torch.cuda.synchronize()
    assert bool((dst[0].view(blocks, block)[lo // block] == 1).all()), "the copy did not land"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
