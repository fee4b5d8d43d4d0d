#!/usr/bin/env bash
# Why DIRECT's data plane on one GPU host cost ~0.55 ms more than the bare-NIXL floor's READ of
# the same descriptors (docs/benchmarks.md, "Session 18"; written then, first run as session
# 19's call 2). The probe reads 1 GiB of contiguous blocks (32 descriptors) with the floor's
# loop and through the TransferEngine in one process pair (the post call and the wait apart,
# with and without a 1 us timer slack on the NIXL thread); then the bench's DIRECT and KERNEL
# rows, each strategy on its own so that both get latency rows.
. bench/device/env.sh
machine
step "probe: floor loop against the TransferEngine, 1 GiB contiguous"
timeout 120 python3 -m bench.studies.direct_engine_floor --device cuda:0 --repeat 9 2>&1 \
  | grep -v '^\[' | tail -16
for s in direct kernel; do
  step "bench, $s"
  timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
    --patterns fragmented,contiguous --strategy "$s" --repeat 3 --latency-pulls 200 \
    --json "$OUT/bench-$s.json" 2>&1 | tail -24
done
step "done"
