#!/usr/bin/env bash
# One short call on the lent GPU machine (session 7: StartPull wait, the GPU identity check, the
# vLLM GPU path with tp/fp8). Carry .whl/ (bench/device/session.sh says which wheels). Steps
# time-boxed; outputs under $OUT; the short table last.
. bench/device/env.sh
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels"
timeout 200 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

step "gpu tests: ipc, attach, vllm, kernels"
timeout "${TESTS_S:-150}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/ipc \
  tests/attach tests/vllm tests/kernels > "$OUT/tests-gpu.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-gpu.log" | tail -12

step "bench: KERNEL, 16-block latency both ways, 1 GiB random"
timeout "${BENCH_S:-150}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented --strategy kernel --repeat 5 --latency-pulls 200 \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
sed -n '/^tokens /,$p' "$OUT/bench.log" | tail -24
step "done"
