#!/usr/bin/env bash
# Session 17, second call, run at 5ef64b3 (armed KERNEL launches: cuda/gates.cu,
# kvxferd/ipc/armed.py; reverted after this call, docs/benchmarks.md "Session 17"). Every
# gpu test; the interleaved A/B of _base (04aac15, main at the session's start) against this
# tree, 16-block KERNEL pulls; this tree's decode daemon stamped; the bench's KERNEL table.
. bench/device/env.sh
machine
build_kernels
TESTS_S=240 gpu_tests "all" tests
step "interleaved A/B, 16 blocks"
timeout 150 python3 -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \
  --pulls 2000 --rounds 2 --json "$OUT/ab-16.json" | tail -12
step "control path, decode daemon stamped"
rm -rf /tmp/tl && mkdir -p /tmp/tl
PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH KVX_TIMELINE_DIR=/tmp/tl timeout 150 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 --pulls 2000 \
  --json "$OUT/cp-timeline.json" | tail -4
python3 -m bench.timeline_report /tmp/tl > "$OUT/timeline.txt"; cat "$OUT/timeline.txt"
step "bench, KERNEL"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | tail -30
step "done"
