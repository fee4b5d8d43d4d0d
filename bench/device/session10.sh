#!/usr/bin/env bash
# Session 10, first call: the kernels built, the gpu tests of the KERNEL path (its host work now
# done while the lease confirmation is in flight), and bench.ipc_kernel with the ready rows and
# a small pull's launch taken apart. The A/B against the previous main follows on the warm
# machine (bench/device/ab.sh).
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-240} gpu_tests "ipc and kernels" tests/ipc tests/kernels
step "bench.ipc_kernel"
timeout 260 python3 -m bench.ipc_kernel --caps 64,0 --repeat 10 --pulls 200 \
  --json "$OUT/ipc-kernel.json" > "$OUT/ipc-kernel.log" 2>&1
echo "rc=$?"
grep -E "launch parts|p50" "$OUT/ipc-kernel.log" | tail -30
step "done"
