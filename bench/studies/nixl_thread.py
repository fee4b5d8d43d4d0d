"""Session 20 study: could a DIRECT pull skip its two hand-offs between the event loop and the
NIXL thread by posting (and polling) on the event loop itself?

Two measurements, on host memory (no GPU needed):

* **The hand-off's price.** A function queued on :class:`kvxferd.nixl.worker.NixlThread` from
  an asyncio loop (uvloop) and awaited, as ``TransferEngine.submit`` does, with the loop idle
  2 ms between calls as a daemon's is between pulls: the time until the function starts on the
  NIXL thread, the time until the loop has its result, and the same from a blocking caller.
* **Does NIXL hold the GIL?** A reader agent posts READs of ``--descs`` 64 KiB descriptors
  from an owner process (``initialize_xfer``, ``transfer``, then ``check_xfer_state`` until
  done) on its NIXL thread while another Python thread counts its own loop turns. If the other
  thread advances during a call, the binding released the GIL for it: the event loop runs on
  while the NIXL thread posts, and a post made on the loop itself would hold the loop for as
  long as the post call lasts.

    python -m bench.studies.nixl_thread [--calls 3000] [--descs 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch
import uvloop

from kvxferd.nixl import MemType, NixlAgent
from kvxferd.nixl.worker import NixlThread
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec

BLOCK = 64 << 10
LAYERS = 8
IDLE_S = 0.002


def _started(t0: float) -> float:
    return time.perf_counter() - t0


def handoffs(calls: int) -> None:
    thread = NixlThread("study")
    thread.start()

    async def from_loop() -> tuple[list[float], list[float]]:
        to, back = [], []
        for _ in range(calls):
            await asyncio.sleep(IDLE_S)
            t0 = time.perf_counter()
            started = await asyncio.wrap_future(thread.submit(_started, t0))
            to.append(started)
            back.append(time.perf_counter() - t0 - started)
        return to, back

    to, back = uvloop.run(from_loop())
    blocking_to, blocking_all = [], []
    for _ in range(calls):
        time.sleep(IDLE_S)
        t0 = time.perf_counter()
        blocking_to.append(thread.submit(_started, t0).result())
        blocking_all.append(time.perf_counter() - t0)
    thread.stop()

    def us(v: list[float]) -> str:
        return f"{statistics.median(v) * 1e6:7.1f}"

    print(f"hand-offs, p50 of {calls} calls, the caller idle {IDLE_S * 1e3:g} ms between, us:")
    print(f"  from the event loop: to the NIXL thread {us(to)}, back to the loop {us(back)}")
    print(
        f"  from a blocking caller: to the NIXL thread {us(blocking_to)},"
        f" round trip {us(blocking_all)}"
    )


def _rows(base: np.ndarray, nb: int) -> np.ndarray:
    blocks = np.arange(nb, dtype=np.int64) * BLOCK
    addr = (base[:, None] + blocks[None, :]).ravel()
    return np.stack([addr, np.full_like(addr, BLOCK), np.zeros_like(addr)], axis=1)


def gil(descs: int) -> None:
    nb = max(1, descs // LAYERS)
    owner = OwnerProcess(OwnerSpec("study-owner", (nb * BLOCK,) * LAYERS, fill=False))
    agent = NixlAgent("study-reader")
    agent.start()
    try:
        bufs = [torch.zeros(nb * BLOCK, dtype=torch.uint8) for _ in range(LAYERS)]
        regions = np.array([[b.data_ptr(), b.numel(), 0] for b in bufs], dtype=np.int64)
        agent.register(regions, MemType.DRAM)
        agent.add_remote(owner.name, owner.metadata)
        local = _rows(regions[:, 0], nb)
        remote = _rows(owner.regions[:, 0].astype(np.int64), nb)

        def run() -> dict[str, list[tuple[float, float]]]:
            raw: Any = agent._agent  # study only: we are on the NIXL thread (agent.submit)
            spans: dict[str, list[tuple[float, float]]] = {"initialize_xfer": [], "transfer": []}
            spans["check_xfer_state (each)"] = []
            for _ in range(3):
                t0 = time.perf_counter()
                h = raw.initialize_xfer(
                    "READ",
                    raw.get_xfer_descs(local, "DRAM"),
                    raw.get_xfer_descs(remote, "DRAM"),
                    owner.name,
                )
                t1 = time.perf_counter()
                raw.transfer(h)
                t2 = time.perf_counter()
                spans["initialize_xfer"].append((t0, t1))
                spans["transfer"].append((t1, t2))
                while True:
                    t3 = time.perf_counter()
                    state = raw.check_xfer_state(h)
                    spans["check_xfer_state (each)"].append((t3, time.perf_counter()))
                    if state != "PROC":
                        break
                raw.release_xfer_handle(h)
            return spans

        ticks: list[float] = []
        stop = threading.Event()

        def count() -> None:
            while not stop.is_set():
                ticks.append(time.perf_counter())

        counter = threading.Thread(target=count)
        counter.start()
        try:
            spans = agent.submit(run).result()
        finally:
            stop.set()
            counter.join()
        at = np.array(ticks)
        print(
            f"\nNIXL calls on the NIXL thread ({descs} descriptors of 64 KiB, host memory)"
            " while another Python thread counts its turns:"
        )
        for name, calls in spans.items():
            ms = [(b - a) * 1e3 for a, b in calls]
            turns = [int(((at > a) & (at < b)).sum()) for a, b in calls]
            print(
                f"  {name:26s} median {statistics.median(ms):8.3f} ms, the other thread's"
                f" turns during it: median {statistics.median(turns)}, max {max(turns)}"
            )
    finally:
        agent.close()
        owner.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--descs", type=int, default=2048)
    args = ap.parse_args(argv)
    handoffs(args.calls)
    gil(args.descs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
