#!/usr/bin/env bash
# Session 20, call 1: the KERNEL copy's loop with more bytes in flight per thread
# (bench/studies/copy_unroll.cu), the daemon's own copy beside it (bench.ipc_kernel), and every
# gpu test at main (the last commit of session 19 had not run on a GPU).
. bench/device/env.sh
machine
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
step "copy_unroll study"
$NVCC -O3 -arch=sm_90 -o /tmp/copy_unroll bench/studies/copy_unroll.cu && timeout 120 /tmp/copy_unroll \
  | tee "$OUT/copy-unroll.txt"
build_kernels
step "bench.ipc_kernel, caps 64 and 0"
timeout 150 python3 -m bench.ipc_kernel --caps 64,0 --repeat 10 --pulls 200 \
  --json "$OUT/ipc-kernel.json" 2>&1 | tail -30
TESTS_S=300 gpu_tests "main at session 20's start" tests
step "done"
