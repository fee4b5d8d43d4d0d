#!/usr/bin/env bash
# Session 16, sixth call: the KERNEL launch through the extension's binding
# (cuda/bindings.cpp). Every gpu test; the interleaved A/B of _base (main at the session's
# start, b699943) against this tree, 16-block pulls in two rounds and 512-block pulls in one;
# this tree's decode daemon stamped (bench/timeline_hook).
. bench/device/env.sh
machine
build_kernels
TESTS_S=260 gpu_tests "all" tests
step "interleaved A/B, 16 blocks"
timeout 150 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --rounds 2 --json "$OUT/ab-16.json" | tail -12
step "interleaved A/B, 512 blocks"
timeout 100 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --blocks 512 --pulls 300 --warmup 30 --json "$OUT/ab-512.json" | tail -6
step "control path, decode daemon stamped"
rm -rf /tmp/tl && mkdir -p /tmp/tl
PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH KVX_TIMELINE_DIR=/tmp/tl timeout 120 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --json "$OUT/cp-timeline.json"
python3 -m bench.timeline_report /tmp/tl > "$OUT/timeline.txt"
grep -E "pulls;|answer_in>|mark:confirm|launch|op[<>]|wait_event<|update:DONE|serve<" "$OUT/timeline.txt"
step "done"
