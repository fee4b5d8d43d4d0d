#!/usr/bin/env bash
# Second call of session 8 on the lent GPU machine: the gpu tests of the areas changed after
# the first call (the engine mapping OWNED VRAM exports by GPU UUID), then the bench with the
# control path's floor (one GetTransfer round trip) and the wait-mode pulls run without a
# WatchTransfers stream: KERNEL (issue 13), then DIRECT (issue 14: added over the NIXL floor).
. bench/device_env.sh
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels"
timeout 200 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

step "gpu tests: attach, vllm, ipc, kernels"
timeout "${TESTS_S:-200}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/attach \
  tests/vllm tests/ipc tests/kernels > "$OUT/tests-gpu.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-gpu.log" | tail -12

for s in kernel direct; do
  step "bench: $s"
  timeout "${BENCH_S:-120}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
    --patterns fragmented,contiguous --strategy $s --repeat 3 --latency-pulls 300 \
    --json "$OUT/bench-$s.json" > "$OUT/bench-$s.log" 2>&1
  echo "bench rc=$?"
  sed -n '/^tokens /,$p' "$OUT/bench-$s.log" | grep -vE "^raw copy:" | tail -22
done
step "done"
