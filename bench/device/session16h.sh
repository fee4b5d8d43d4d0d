#!/usr/bin/env bash
# Session 16, last call: the bench table (16-block KERNEL latency on the socket and over gRPC,
# 1 GiB random and contiguous against the raw copy and the bare-NIXL floor) at the session's
# last code. JSON: $OUT/bench.json.
. bench/device/env.sh
machine
build_kernels
step "kvxferd bench, KERNEL"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | tail -40
step "done"
