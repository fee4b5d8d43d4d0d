#!/usr/bin/env bash
# Session 23, call 1: every gpu test at the session's code (DeclinePull of a released request,
# the engine client's cleanup of a failed attach, an OWNED VRAM Attach that cannot allocate),
# and the bench's KERNEL and DIRECT rows (issues 13 and 14; nothing on a pull's path changed).
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "session 23" tests
step "bench, kernel and direct"
timeout 240 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | sed -n '/^tokens /,$p' | tail -40
step "done"
