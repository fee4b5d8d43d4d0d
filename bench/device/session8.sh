#!/usr/bin/env bash
# One call on the lent GPU machine (session 8: every gpu test after the CMA, lease-confirmation
# and KERNEL-pieces changes; the bench table; KernelReader.pull's own split). Carry .whl/
# (bench/device/session.sh says which wheels). Steps time-boxed; outputs under $OUT; the short
# table last.
. bench/device/env.sh
machine
build_kernels
gpu_tests all tests

step "KernelReader.pull without the daemons (cap 0)"
timeout "${IPC_S:-90}" python3 -m bench.ipc_kernel --caps 0 --repeat 10 --pulls 300 \
  --json "$OUT/ipc.json" > "$OUT/ipc.log" 2>&1
echo "ipc rc=$?"
grep -iE "pull|cut" "$OUT/ipc.log" | tail -12

step "bench: KERNEL and DIRECT, 16-block latency, 1 GiB random and contiguous"
timeout "${BENCH_S:-150}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
sed -n '/^tokens /,$p' "$OUT/bench.log" | tail -30
step "done"
