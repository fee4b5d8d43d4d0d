#!/usr/bin/env bash
# Session 10, last call: every gpu test at the session's final code, then the KERNEL bench
# table (16-block latency three ways, 1 GiB random and contiguous).
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-330} gpu_tests all tests
step "bench: kernel"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 5 --latency-pulls 200 \
  --json "$OUT/bench-kernel.json" > "$OUT/bench-kernel.log" 2>&1
echo "bench rc=$?"
sed -n '/^tokens/,$p' "$OUT/bench-kernel.log" | grep -vE "^raw copy:" | tail -24
step "done"
