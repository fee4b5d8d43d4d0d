#!/usr/bin/env bash
# Third call of session 8 on the lent GPU machine, at the session's last code: every gpu test,
# then the small-pull latency both ways for KERNEL and DIRECT with the control floor (each
# watch block now starts with an untimed pull while the new stream's snapshot drains).
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-250} gpu_tests all tests

for s in kernel direct; do
  step "bench: $s, 16-block latency"
  timeout "${BENCH_S:-100}" python3 -m kvxferd bench --device cuda --sizes 256 \
    --patterns fragmented --strategy $s --repeat 3 --latency-pulls 300 \
    --json "$OUT/bench-$s.json" > "$OUT/bench-$s.log" 2>&1
  echo "bench rc=$?"
  sed -n '/^small-request/,$p' "$OUT/bench-$s.log" | tail -10
done
step "done"
