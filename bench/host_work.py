"""The decode daemon's host work for one KERNEL pull, alone and on the CPU: ``plan_pull``, the
strategy decision (``decide``) and the KERNEL preparation (``KernelReader.ready``: pieces,
checks, launch tables), as the reader runs them before a pull's lease is confirmed.

No GPU is needed: the owner's regions are "mapped" through the CPU stand-ins of the IPC tests
(tests/ipc/fakes.py), so everything but the launch is the daemon's code. Each call is timed
on random block IDs of the llama-shaped pool (32 layers, 64 KiB per block per layer):

    python -m bench.host_work [--blocks 16] [--pool dense:num_blocks=600] [--calls 3000]
        [--between none|sleep:US|spin:US|thrash:MB]

``--between`` says what runs between two timed pulls, to tell the interpreter's speed with its
caches warm (``none``: pulls back to back) from its speed as a daemon runs the same steps, with
other work between its pulls: ``sleep:US`` sleeps, ``spin:US`` spins on the clock, ``thrash:MB``
writes a buffer of that many MiB (this process's own caches evicted).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvxferd.blocks import plan_pull
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.reader import KernelReader
from kvxferd.ipc.transport import classify
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import MemoryType
from kvxferd.pool import KVPool
from kvxferd.staging.setup import IpcSide, Staging, decide
from kvxferd.staging.strategy import CostModel, Mode
from tests.ipc.fakes import FakeHost, FakeInfo, FakeLink, FakeRemote, export_pool, ordinal_of


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default="dense:num_blocks=600")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--between", default="none", help="none, sleep:US, spin:US or thrash:MB")
    args = ap.parse_args(argv)
    between = _between(args.between)
    spec = preset(args.pool).with_memory(MemoryType.VRAM)
    owner, pool = KVPool.allocate(preset(args.pool)), KVPool.allocate(preset(args.pool))
    fakes = FakeHost()
    cache = MappingCache(device=0, opener=fakes.open, ordinal_of=ordinal_of)
    staging = Staging(
        Mode.AUTO,
        CostModel.defaults(MemoryType.VRAM),
        ipc=IpcSide(host_id="host"),
        kernel=KernelReader(pool, cache, max_ctas=64),
    )
    rows = np.array([[1 << 20, r.nbytes, 0] for r in spec.regions], dtype=np.int64)
    fast = classify(local_vram=True, remote_vram=True, same_host=True, gbps=300.0)
    remote = FakeRemote(FakeInfo(spec), rows, "host", export_pool(fakes, owner, "owner"))
    link = FakeLink(remote, fast)
    n_blocks = spec.num_kernel_blocks(0)
    rng = random.Random(1)

    def one() -> tuple[float, float, float]:
        local = rng.sample(range(n_blocks), args.blocks)
        remote = rng.sample(range(n_blocks), args.blocks)
        between()
        t0 = time.perf_counter()
        plan = plan_pull(spec, spec, [local], [remote], prefix_caching=True)
        part = plan.per_rank[0]
        t1 = time.perf_counter()
        decide(
            staging,
            local=spec,
            remote=spec,
            local_tp_size=1,
            remote_tp_size=1,
            remote_ring=None,
            plan=plan,
            part=part,
            peer="owner:1",
            link=link,  # type: ignore[arg-type]
        )
        t2 = time.perf_counter()
        ready = staging.kernel_ready(link.remote, part)  # type: ignore[arg-type]
        assert ready is not None, "the pull was not prepared"
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for _ in range(300):
        one()
    times = [one() for _ in range(args.calls)]
    shape = f"{args.pool}, between: {args.between}"
    print(f"{args.calls} pulls of {args.blocks} blocks ({shape}), p50 us:")
    for i, name in enumerate(("plan_pull", "decide", "kernel_ready")):
        print(f"  {name:13s} {statistics.median(t[i] for t in times) * 1e6:7.1f}")
    print(f"  {'total':13s} {statistics.median(sum(t) for t in times) * 1e6:7.1f}")
    return 0


def _between(what: str) -> Callable[[], None]:
    """What runs before each pull (``--between``)."""
    kind, _, value = what.partition(":")
    if kind == "none":
        return lambda: None
    amount = float(value) if value else 0.0
    if kind == "sleep":
        return lambda: time.sleep(amount / 1e6)
    if kind == "spin":

        def spin() -> None:
            end = time.perf_counter() + amount / 1e6
            while time.perf_counter() < end:
                pass

        return spin
    if kind == "thrash":
        buf = np.zeros(int(amount * (1 << 20)), dtype=np.uint8)

        def thrash() -> None:
            np.add(buf, 1, out=buf)

        return thrash
    raise SystemExit(f"--between: none, sleep:US, spin:US or thrash:MB, not {what!r}")


if __name__ == "__main__":
    raise SystemExit(main())
