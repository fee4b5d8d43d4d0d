#!/usr/bin/env bash
# Second call of session 8 on the lent GPU machine: the gpu tests of the areas changed after
# the first call (the engine mapping OWNED VRAM exports by GPU UUID), then the bench with the
# control path's floor (one GetTransfer round trip) and the wait-mode pulls run without a
# WatchTransfers stream: KERNEL (issue 13), then DIRECT (issue 14: added over the NIXL floor).
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-200} gpu_tests "attach, vllm, ipc, kernels" tests/attach tests/vllm tests/ipc \
  tests/kernels

for s in kernel direct; do
  step "bench: $s"
  timeout "${BENCH_S:-120}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
    --patterns fragmented,contiguous --strategy $s --repeat 3 --latency-pulls 300 \
    --json "$OUT/bench-$s.json" > "$OUT/bench-$s.log" 2>&1
  echo "bench rc=$?"
  sed -n '/^tokens /,$p' "$OUT/bench-$s.log" | grep -vE "^raw copy:" | tail -22
done
step "done"
