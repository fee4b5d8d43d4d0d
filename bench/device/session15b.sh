#!/usr/bin/env bash
# Session 15, second call: every gpu test at the session's code; _base (the previous main) and
# this tree alternating per round (ROUNDS, default "1 2") through the daemons, 16-block KERNEL
# pulls on cuda:0; then this tree's bench table (KERNEL; 16-block latency, 32 MiB and 1 GiB rows).
. bench/device/env.sh
machine
build_kernels
[ "${GPU_TESTS:-1}" = 1 ] && TESTS_S=230 gpu_tests "every gpu test" tests
ROUNDS=${ROUNDS:-1 2} control_ab ""
step "kvxferd bench, KERNEL, this tree"
timeout 130 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench-new.json" > "$OUT/bench-new.log" 2>&1
echo "bench rc=$?"
tail -25 "$OUT/bench-new.log"
step "done"
