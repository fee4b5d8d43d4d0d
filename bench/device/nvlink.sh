#!/usr/bin/env bash
# Issue 17 (two GPUs over NVLink), on nvidia-h200-x2 (session 20, the first time that kind was
# lent): prefill on cuda:0, decode on cuda:1. The topology, every gpu test, the bench's table
# (raw GPU-to-GPU copy, naive, bare-NIXL floor, DIRECT, STAGED, KERNEL, auto; 256 and 8,192
# tokens, contiguous and random; the 16-block latency) and engine-attached (owned export,
# imported) against daemon-owned. NVLink multicast stays off (the machine's environment); kvxferd
# never uses it.
. bench/device/env.sh
machine
nvidia-smi topo -m 2>&1 | head -6
build_kernels
step "bench, every strategy, cuda:0 -> cuda:1"
timeout 300 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct,staged,auto --repeat 3 \
  --latency-pulls 200 --json "$OUT/bench-nvlink.json" > "$OUT/bench-nvlink.log" 2>&1
echo "bench rc=$?"; sed -n '/^tokens /,$p' "$OUT/bench-nvlink.log" | tail -60
step "engine-attached against daemon-owned"
timeout 200 python3 -m bench.attached_pull --device cuda --sources owned,attached,imported \
  --json "$OUT/attached-nvlink.json" 2>&1 | tail -20
TESTS_S=280 gpu_tests "two GPUs" tests
step "done"
