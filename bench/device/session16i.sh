#!/usr/bin/env bash
# Session 16, last call: the interleaved A/B of _base (b699943, main at the session's start)
# against this tree at the session's last code, 16-block KERNEL pulls, two rounds.
. bench/device/env.sh
machine
build_kernels
step "interleaved A/B, 16 blocks"
timeout 170 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --pulls 2000 --rounds 2 --json "$OUT/ab-final.json" | tail -12
step "done"
