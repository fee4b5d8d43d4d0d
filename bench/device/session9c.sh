#!/usr/bin/env bash
# Third call of session 9 on the lent GPU machine: the grouped KERNEL copy (copy_group: a pull's
# runs once, repeated over the layers by the kernel). Build, every gpu test, then the
# KernelReader-only bench (grouped against flattened, the same process).
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-260} gpu_tests all tests
step "bench.ipc_kernel"
timeout 200 python3 -m bench.ipc_kernel --caps 0,64 --repeat 10 --pulls 300 \
  --json "$OUT/ipc.json" > "$OUT/ipc.log" 2>&1
echo "ipc rc=$?"
grep -E "^(pull|copy imported random|copy imported contiguous|raw)|p50" "$OUT/ipc.log" | tail -40
step "done"
