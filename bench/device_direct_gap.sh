#!/usr/bin/env bash
# For the next GPU call (written in session 18, not yet run): why DIRECT's data plane on one
# GPU host costs ~0.55 ms more than the bare-NIXL floor's READ of the same descriptors
# (docs/benchmarks.md, "Session 18"). The probe reads 1 GiB of contiguous blocks (32
# descriptors) with the floor's loop and through the TransferEngine in one process pair; then
# the bench's DIRECT and KERNEL rows, each strategy on its own so that both get latency rows.
. bench/device_env.sh
machine
step "probe: floor loop against the TransferEngine, 1 GiB contiguous"
timeout 120 python3 -m bench.studies.direct_engine_floor --device cuda:0 --repeat 9 2>&1 \
  | grep -v '^\[' | tail -8
for s in direct kernel; do
  step "bench, $s"
  timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
    --patterns fragmented,contiguous --strategy "$s" --repeat 3 --latency-pulls 200 \
    --json "$OUT/bench-$s.json" 2>&1 | tail -22
done
step "done"
