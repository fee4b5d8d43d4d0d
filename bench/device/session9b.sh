#!/usr/bin/env bash
# Second call of session 9 on the lent GPU machine, at the scheduler socket's code: every gpu
# test, then `kvxferd bench` for KERNEL and DIRECT (16-block latency pulls three ways: watch
# and wait over gRPC, wait on the decode daemon's scheduler socket; 1 GiB cells on the socket).
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-260} gpu_tests all tests

for s in kernel direct; do
  step "bench: $s"
  timeout "${BENCH_S:-150}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
    --patterns fragmented,contiguous --strategy $s --repeat 5 --latency-pulls 300 \
    --json "$OUT/bench-$s.json" > "$OUT/bench-$s.log" 2>&1
  echo "bench rc=$?"
  sed -n '/^tokens/,$p' "$OUT/bench-$s.log" | grep -v "^raw copy:" | tail -26
done
step "done"
