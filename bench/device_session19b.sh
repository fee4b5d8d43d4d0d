#!/usr/bin/env bash
# Session 19, call 2: the probe split into the post call and the wait (floor and engine), with
# and without a 1 us timer slack on the NIXL thread; then the bench's DIRECT rows (the data
# plane now from the post call's start, started_unix_ns) and its KERNEL rows, each strategy on
# its own so that both get latency rows.
. bench/device_env.sh
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
