"""A tiny engine for tests: attach, stamp every block, hold, print the ticket, wait.

Run as ``python -m tests.attach.engine_proc --socket PATH [--mode owned|imported] ...``
(``--mode imported --device cuda:0``: the engine's own CUDA tensors, served with KERNEL). It
prints one JSON line ``{"ticket": ..., "attachment_id": ..., "generation": ...}`` once the
hold is made, then waits for ``detach`` on stdin (or to be killed). The stamps are
:meth:`KVPool.fill_pattern`'s, so a reader's Checksum digests can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from kvxferd.attach import region_tensor
from kvxferd.blocks import expand_group
from kvxferd.engine import EngineClient, ReleaseEvent, shared_tensors
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.pool import KVPool


def carved(spec: KVCacheSpec, device: str) -> dict[str, torch.Tensor]:
    """The spec's regions as views into one allocation, the first 4 KiB in, each 256-aligned."""
    spec = spec.with_memory(MemoryType.VRAM if device.startswith("cuda") else MemoryType.DRAM)
    offsets, at = [], 4096
    for r in spec.regions:
        offsets.append(at)
        at += (r.nbytes + 255) // 256 * 256
    flat = torch.empty(at, dtype=torch.uint8, device=device)
    return {
        r.name: region_tensor(r, flat[o : o + r.nbytes])
        for r, o in zip(spec.regions, offsets, strict=True)
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--mode", default="owned", choices=("owned", "imported"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="dense:num_blocks=64")
    ap.add_argument(
        "--carve",
        action="store_true",
        help="imported: every region a view into one allocation, 4 KiB in (one CUDA IPC handle,"
        " an offset per region)",
    )
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--request", default="req-0")
    ap.add_argument(
        "--blocks", default="0,1,2,3", help="logical block IDs to hold, groups separated by ';'"
    )
    ap.add_argument("--readers", type=int, default=1)
    ap.add_argument(
        "--overwrite-on-release",
        type=int,
        metavar="SEED",
        help="reuse released blocks at once, as a real engine would: restamp them with SEED",
    )
    args = ap.parse_args()
    client = EngineClient(args.socket)
    tensors = None
    if args.mode == "imported":
        spec = preset(args.preset)
        tensors = carved(spec, args.device) if args.carve else shared_tensors(spec, args.device)
    att = client.attach(args.preset, args.mode, args.device, tensors=tensors)
    pool = KVPool(att.spec, att.tensors)
    for g in range(len(att.spec.groups)):
        pool.fill_pattern(g, range(att.spec.num_kernel_blocks(g)), args.seed)
    if args.overwrite_on_release is not None:
        seed = args.overwrite_on_release

        def reuse(event: ReleaseEvent) -> None:
            for g, ids in enumerate(event.block_ids):
                kernel = expand_group(att.spec.groups[g], np.asarray(ids, dtype=np.int64))
                pool.fill_pattern(g, kernel.tolist(), seed)
            print(json.dumps({"released": event.request_id, "reason": event.reason}), flush=True)

        att.on_release(reuse)
    blocks = [[int(b) for b in group.split(",")] for group in args.blocks.split(";")]
    ticket = att.hold(args.request, blocks, readers=args.readers)
    out = {
        "ticket": ticket.to_json(),
        "attachment_id": att.attachment_id,
        "generation": att.generation,
    }
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        if line.strip() == "detach":
            n = att.detach()
            print(json.dumps({"detached": n}), flush=True)
            break
    client.close()
    return 0


if __name__ == "__main__":
    rc = main()
    # Leave without the interpreter's finalization: with IMPORTED host memory this process
    # aborted now and then after main() had returned 0 ("terminate called without an active
    # exception", no Python frame left; about 1 exit in 3 on a loaded 2-core machine), in
    # native teardown (grpcio's, or torch's of tensors over mmap'd shared memory: not pinned
    # down). What the tests check, the attach protocol and a clean detach, is done by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
