#!/usr/bin/env bash
# Session 18, second call: the bench with DIRECT beside KERNEL again, its bare-NIXL floor now
# posted and polled on the agent's NIXL thread (kvxferd/scenario/naive.py).
. bench/device/env.sh
machine
step "bench, DIRECT and KERNEL"
timeout 300 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy direct,kernel --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | tail -40
step "done"
