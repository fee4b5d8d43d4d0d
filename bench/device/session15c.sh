#!/usr/bin/env bash
# Session 15, last call: _base (the previous main) and this tree as two decode daemons against
# one prefill daemon, pulls alternating (bench/control_ab.py): 16-block KERNEL pulls on cuda:0,
# then 512-block (1 GiB) pulls. JSON: $OUT/ab-16.json, $OUT/ab-512.json.
. bench/device/env.sh
machine
build_kernels
step "interleaved A/B, 16 blocks"
timeout 150 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --json "$OUT/ab-16.json"
step "interleaved A/B, 512 blocks"
timeout 120 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --blocks 512 --pulls "${BIG_PULLS:-300}" --warmup 30 --json "$OUT/ab-512.json"
step "done"
