#!/usr/bin/env bash
# Session 16, second call: the interleaved A/B of _base (main at the session's start) against
# this tree (16-block, then 512-block KERNEL pulls), this tree's decode daemon stamped
# (bench/timeline_hook), and the gpu tests of the KERNEL path.
. bench/device/env.sh
machine
build_kernels
step "interleaved A/B, 16 blocks"
timeout 150 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --rounds 2 --json "$OUT/ab-16.json" | tail -12
step "control path, decode daemon stamped"
rm -rf /tmp/tl && mkdir -p /tmp/tl
PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH KVX_TIMELINE_DIR=/tmp/tl timeout 150 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --json "$OUT/cp-timeline.json"
python3 -m bench.timeline_report /tmp/tl > "$OUT/timeline.txt"; cat "$OUT/timeline.txt"
TESTS_S=200 gpu_tests "ipc, kernels" tests/ipc tests/kernels
step "done"
