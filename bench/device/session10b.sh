#!/usr/bin/env bash
# Session 10, second call: copy_group tables of at most 480 values passed as the launch's
# parameter and the reader's stream passed to the op (no context): kernels rebuilt, the gpu
# tests of ipc and kernels, bench.ipc_kernel; then one A/B round against the previous main
# (_base, bench/device/ab.sh) on the same warm machine.
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-200} gpu_tests "ipc and kernels" tests/ipc tests/kernels
step "bench.ipc_kernel"
timeout 200 python3 -m bench.ipc_kernel --caps 64,0 --repeat 10 --pulls 200 \
  --json "$OUT/ipc-kernel.json" > "$OUT/ipc-kernel.log" 2>&1
echo "rc=$?"
grep -E "launch parts|p50" "$OUT/ipc-kernel.log" | tail -8
step "A/B against _base"
ROUNDS=${ROUNDS:-1} STRATEGIES=kernel OUT=$OUT/ab bash bench/device/ab.sh
step "done"
