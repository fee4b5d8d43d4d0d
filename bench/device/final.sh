#!/usr/bin/env bash
# One call on the lent GPU machine: every gpu-marked test, then the bench table (KERNEL, DIRECT,
# STAGED on one GPU: 16-block latency, 1 GiB random and contiguous) and the imported-VRAM
# comparison. Carry .whl/ (bench/device/session.sh); results under $OUT; the short table last.
. bench/device/env.sh
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels"
timeout 240 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

step "every gpu-marked test"
timeout "${TESTS_S:-300}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests \
  > "$OUT/tests-gpu.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-gpu.log" | tail -20

step "bench: KERNEL, DIRECT, STAGED (16-block latency, 1 GiB)"
timeout "${BENCH_S:-220}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct,staged --repeat 3 \
  --latency-pulls 200 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"

step "imported vs owned (KERNEL)"
timeout "${IMPORTED_S:-100}" python3 -m bench.attached_pull --device cuda --repeat 3 \
  --latency-pulls 200 --json "$OUT/imported.json" > "$OUT/imported.log" 2>&1
echo "attached_pull rc=$?"
sed -n '/^pattern /,$p' "$OUT/imported.log"

step "the bench table"
sed -n '/^tokens /,$p' "$OUT/bench.log" | tail -30
step "done"
