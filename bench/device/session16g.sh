#!/usr/bin/env bash
# Session 16, seventh call: the launch through the binding (cuda/bindings.cpp) against the op
# (_base = 75a42a4, this session's first commit): the host cost alone, hot and with the caches
# cooled (bench/studies/launch_cost.py), and one round of the interleaved A/B.
. bench/device/env.sh
machine
build_kernels
step "launch cost, part by part"
timeout 200 python3 -m bench.studies.launch_cost
step "interleaved A/B, 16 blocks: the op (base) against the binding"
timeout 150 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --pulls 2000 --rounds 2 --json "$OUT/ab-binding.json" | tail -12
step "done"
