"""Measure the DRAM constants of the DIRECT/STAGED cost model on this machine.

Run from the repository root: ``python -m bench.staging_costs`` (``--json PATH`` to keep the
figures). Three measurements, medians of ``--repeat`` runs:

* **descriptor cost and link bandwidth** (NIXL READ between two processes over UCX on
  loopback): the same ``--mib`` MiB read as one descriptor per 32 MiB region (bandwidth
  bound: ``link = bytes / t``); ``n`` random 1 KiB descriptors against one descriptor of
  ``n`` KiB (``descriptor = (t_n - t_1) / n``, the copy being negligible); and every 64 KiB
  block in random order (``descriptor_us_64k``: what remains of it when copies overlap it);
* **gather / scatter bandwidth**: :func:`kvxferd.kernels.gather_blocks` /
  :func:`~kvxferd.kernels.scatter_blocks` (the torch twin on CPU) of random 2 MiB block rows
  (32 regions x 64 KiB) into a 64 MiB slot;
* **per-chunk cost**: ``Peer.Gather`` round trips to a real daemon for a one-block (2 MiB)
  chunk, minus the gather time the owner reports (the release rides on the next Gather).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxferd.kernels import gather_blocks, scatter_blocks
from kvxferd.nixl import MemType, NixlAgent
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec

LAYERS = 32
BLOCK = 64 << 10


def _rows(bases: np.ndarray, nb: int, order: np.ndarray | None) -> np.ndarray:
    blocks = np.arange(nb, dtype=np.int64) * BLOCK
    addr = (bases[:, None] + blocks[None, :]).ravel()
    if order is not None:
        addr = addr[order]
    return np.stack([addr, np.full_like(addr, BLOCK), np.zeros_like(addr)], axis=1)


def nixl_costs(mib: int, repeat: int) -> dict[str, float]:
    nb = (mib << 20) // (LAYERS * BLOCK)
    owner = OwnerProcess(OwnerSpec("cost-owner", (nb * BLOCK,) * LAYERS, fill=False))
    agent = NixlAgent("cost-reader")
    agent.start()
    bufs = [torch.zeros(nb * BLOCK, dtype=torch.uint8) for _ in range(LAYERS)]
    local = np.array([[b.data_ptr(), b.numel(), 0] for b in bufs], dtype=np.int64)
    agent.register(local, MemType.DRAM)
    agent.add_remote(owner.name, owner.metadata)
    remote = owner.regions.astype(np.int64)
    rng = np.random.default_rng(0)

    def read(loc: np.ndarray, rem: np.ndarray) -> float:
        raw = agent._agent  # bench only: on the NIXL thread
        t0 = time.perf_counter()
        h = raw.initialize_xfer(
            "READ",
            raw.get_xfer_descs(loc, "DRAM"),
            raw.get_xfer_descs(rem, "DRAM"),
            owner.name,
        )
        raw.transfer(h)
        while raw.check_xfer_state(h) == "PROC":
            pass
        t = time.perf_counter() - t0
        raw.release_xfer_handle(h)
        return t

    try:
        big_l = local.copy()
        big_r = remote[:, :3].copy()
        agent.submit(read, big_l[:1], big_r[:1]).result()  # warm the connection
        big, frag, tiny, one = [], [], [], []
        n_tiny = nb * LAYERS
        for _ in range(repeat):
            big.append(agent.submit(read, big_l, big_r).result())
            # Descriptor cost with the copy negligible: n x 1 KiB vs one n KiB descriptor.
            order = rng.permutation(nb * LAYERS)
            lt, rt = _rows(local[:, 0], nb, order), _rows(remote[:, 0], nb, order)
            lt[:, 1] = rt[:, 1] = 1024
            tiny.append(agent.submit(read, lt, rt).result())
            lo, ro = local[:1].copy(), remote[:1, :3].copy()
            lo[0, 1] = ro[0, 1] = n_tiny * 1024
            one.append(agent.submit(read, lo, ro).result())
            order = rng.permutation(nb * LAYERS)
            frag.append(
                agent.submit(
                    read, _rows(local[:, 0], nb, order), _rows(remote[:, 0], nb, order)
                ).result()
            )
    finally:
        agent.close()
        owner.close()
    nbytes = nb * LAYERS * BLOCK
    t_big, t_frag = statistics.median(big), statistics.median(frag)
    return {
        "bytes": nbytes,
        "big_descs": LAYERS,
        "frag_descs": nb * LAYERS,
        "t_big_s": t_big,
        "t_frag_s": t_frag,
        "link_gbps": nbytes / t_big / 1e9,
        "descriptor_us_64k": (t_frag - t_big) / (nb * LAYERS - LAYERS) * 1e6,
        "descriptor_us": (statistics.median(tiny) - statistics.median(one)) / n_tiny * 1e6,
    }


def copy_costs(repeat: int) -> dict[str, float]:
    nb = 256
    regions = [torch.randint(0, 255, (nb, BLOCK), dtype=torch.uint8) for _ in range(LAYERS)]
    rows = 32  # 32 rows x 2 MiB = 64 MiB, one default slot
    slot = torch.empty(rows * LAYERS * BLOCK, dtype=torch.uint8)
    rng = np.random.default_rng(1)
    g, s = [], []
    for _ in range(repeat):
        ids = rng.choice(nb, rows, replace=False)
        t0 = time.perf_counter()
        gather_blocks(regions, ids, slot)
        g.append(time.perf_counter() - t0)
        ids = rng.choice(nb, rows, replace=False)
        t0 = time.perf_counter()
        scatter_blocks(regions, ids, slot)
        s.append(time.perf_counter() - t0)
    n = slot.numel()
    return {
        "slot_bytes": n,
        "gather_gbps": n / statistics.median(g) / 1e9,
        "scatter_gbps": n / statistics.median(s) / 1e9,
    }


async def _rtt(prefill: str, sock: str, repeat: int) -> dict[str, float]:
    from grpc import aio

    from kvxferd.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
    from kvxferd.wire.codec import group_ids_to_proto

    engine = engine_pb2_grpc.EngineStub(aio.insecure_channel(f"unix:{sock}"))
    peer = peer_pb2_grpc.PeerStub(aio.insecure_channel(prefill))
    await engine.Hold(engine_pb2.HoldRequest(request_id="rtt", block_ids=group_ids_to_proto([[1]])))
    ids = common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=[1])])
    rtt, gather = [], []
    for i in range(repeat + 5):
        t0 = time.perf_counter()
        r = await peer.Gather(
            peer_pb2.GatherRequest(request_id="rtt", reader_id="bench", kernel_block_ids=ids),
            timeout=5,
        )
        t1 = time.perf_counter()
        await peer.ReleaseStaging(
            peer_pb2.ReleaseStagingRequest(request_id="rtt", reader_id="bench", slots=[r.slot])
        )
        if i >= 5:
            rtt.append(t1 - t0)
            gather.append(r.gather_us / 1e6)
    m_rtt, m_g = statistics.median(rtt), statistics.median(gather)
    return {"rtt_us": m_rtt * 1e6, "gather_us": m_g * 1e6, "chunk_us": (m_rtt - m_g) * 1e6}


def chunk_costs(repeat: int) -> dict[str, float]:
    from kvxferd.scenario.daemons import DaemonOptions, DaemonSet

    with tempfile.TemporaryDirectory() as tmp:
        ds = DaemonSet(Path(tmp), [DaemonOptions("owner", "dense:num_blocks=8")])
        ds.start()
        try:
            ds.wait_ready()
            ready = ds["owner"].ready
            assert ready is not None
            return asyncio.run(_rtt(ready.grpc, ready.engine_socket, repeat))
        finally:
            ds.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes read per NIXL run (MiB)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out: dict[str, Any] = {
        "nixl": nixl_costs(args.mib, args.repeat),
        "copy": copy_costs(args.repeat),
        "chunk": chunk_costs(max(20, args.repeat * 10)),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
