#!/usr/bin/env bash
# Session 18, one call: every gpu test at main (after the WatchTransfers change), and the bench
# with DIRECT beside KERNEL (issue 14's DIRECT against its bare-NIXL floor on the GPU had last
# been measured in session 9, before sessions 10-17 cut the per-pull host work).
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "all" tests
step "bench, DIRECT and KERNEL"
timeout 240 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy direct,kernel --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | tail -40
step "done"
