#!/usr/bin/env bash
# Session 25, call 5: why the bench's single 1 GiB pulls plan, build and confirm at twice the
# back-to-back pulls' time: 512-block pulls of the control path on the bench's pool size (4,096
# blocks) against the control path's (1,200), alternating; then the bench's KERNEL 1 GiB row
# with both daemons' timelines.
. bench/device/env.sh
ROOT=$PWD
machine
build_kernels
for blocks in 1200 4096 1200 4096; do
  step "control path, 512 blocks of a $blocks-block pool"
  timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=$blocks \
    --blocks 512 --pulls 300 --warmup 50 --json "$OUT/cp512-pool$blocks-$RANDOM.json" 2>&1 | head -2
done
step "bench, kernel, 1 GiB random, with timelines"
rm -rf /tmp/tl && mkdir -p /tmp/tl
KVX_TIMELINE_DIR=/tmp/tl PYTHONPATH=$ROOT/bench/timeline_hook:$PYTHONPATH timeout 150 \
  python3 -m kvxferd bench --device cuda --sizes 8192 --patterns fragmented --strategy kernel \
  --repeat 20 --latency-pulls 0 --json "$OUT/bench-timeline.json" 2>&1 | grep -E "kvxferd kernel|^result"
python3 -m bench.timeline_report /tmp/tl > "$OUT/timeline-bench-512.txt" 2>&1
grep -vE "owner:nixl_call" "$OUT/timeline-bench-512.txt" | head -45
step "done"
