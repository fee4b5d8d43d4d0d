"""A tiny engine for tests: attach, stamp every block, hold, print the ticket, wait.

Run as ``python -m tests.attach.engine_proc --socket PATH [--mode owned|imported] ...``. It
prints one JSON line ``{"ticket": ..., "attachment_id": ..., "generation": ...}`` once the
hold is made, then waits for ``detach`` on stdin (or to be killed). The stamps are
:meth:`KVPool.fill_pattern`'s, so a reader's Checksum digests can be compared.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvxferd.engine import EngineClient, shared_tensors
from kvxferd.layout.presets import preset
from kvxferd.pool import KVPool


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--mode", default="owned", choices=("owned", "imported"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="dense:num_blocks=64")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--request", default="req-0")
    ap.add_argument("--blocks", default="0,1,2,3")
    args = ap.parse_args()
    client = EngineClient(args.socket)
    tensors = shared_tensors(preset(args.preset), args.device) if args.mode == "imported" else None
    att = client.attach(args.preset, args.mode, args.device, tensors=tensors)
    pool = KVPool(att.spec, att.tensors)
    for g in range(len(att.spec.groups)):
        pool.fill_pattern(g, range(att.spec.num_kernel_blocks(g)), args.seed)
    ticket = att.hold(args.request, [[int(b) for b in args.blocks.split(",")]])
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
    sys.exit(main())
