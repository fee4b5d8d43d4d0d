#!/usr/bin/env bash
# Session 22, call 2: did the framed sockets' change (653b7d7: connection cap, shared budget for
# unfinished frames, kvxferd/service/local_calls.py) move a pull's latency? An A/B of 16-block
# KERNEL pulls (bench.control_ab: one prefill daemon, two decode daemons, _base = 7466c9b, the
# commit before it, against this tree; the trees swap between rounds), then the bench's
# small-request latency rows again on the same machine.
. bench/device/env.sh
machine
build_kernels
step "control_ab, kernel, llama-shaped pool on cuda:0"
timeout 300 python3 -m bench.control_ab --base _base --device cuda \
  --pool dense:num_blocks=600 --rounds 2 --pulls 2000 --json "$OUT/ab-kernel.json" 2>&1 \
  | grep -v '^\[' | tail -14
step "bench, kernel latency rows"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256 --patterns fragmented \
  --strategy kernel --repeat 1 --latency-pulls 400 --json "$OUT/bench-latency.json" 2>&1 \
  | sed -n '/^small-request/,$p' | tail -12
step "done"
