#!/usr/bin/env bash
# Session 19, call 4: the session's DIRECT work on the GPU host. An A/B of 16-block DIRECT pulls
# (bench.control_ab: one prefill daemon, two decode daemons, _base = f914dc9 against this tree,
# the trees swapped between the two rounds), then the bench's DIRECT rows and every gpu test.
. bench/device/env.sh
machine
build_kernels
step "control_ab, direct, llama-shaped pool on cuda:0"
timeout 200 python3 -m bench.control_ab --base _base --strategy direct --device cuda \
  --pool dense:num_blocks=600 --rounds 2 --pulls 1000 --json "$OUT/ab-direct.json" 2>&1 \
  | grep -v '^\[' | tail -12
step "bench, direct"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy direct --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench-direct.json" 2>&1 | tail -24
TESTS_S=300 gpu_tests "session 19, last code" tests
step "done"
