#!/usr/bin/env bash
# Session 22: every gpu test at the session's last code (DeclinePull, the start-up refusals, the
# Unix sockets' limits and the failed Attach's descriptors), and the bench's KERNEL and DIRECT
# rows (issues 13 and 14: nothing on a pull's path was meant to change).
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "session 22, last code" tests
step "bench, kernel and direct"
timeout 240 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | sed -n '/^tokens /,$p' | tail -40
step "done"
