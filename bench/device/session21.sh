#!/usr/bin/env bash
# Session 21: every gpu test after the detach and push fixes (kvxferd/daemon/quiesce.py, the
# owner's newest description per reader instance), and the bench's KERNEL and DIRECT rows.
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "session 21, detach and push fixes" tests
step "bench, kernel and direct"
timeout 240 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | sed -n '/^tokens /,$p' | tail -40
step "done"
