#!/usr/bin/env bash
# Session 23, call 2: how far apart runs of the same code on one machine are (the 16-block
# KERNEL latency rows, three runs), and where a pull's time goes on both daemons at today's
# code (bench/timeline_hook) for 16-block and 512-block (1 GiB) KERNEL pulls.
. bench/device/env.sh
machine
build_kernels
for run in 1 2 3; do
  step "bench, kernel latency rows, run $run"
  timeout 150 python3 -m kvxferd bench --device cuda --sizes 256 --patterns fragmented \
    --strategy kernel --repeat 1 --latency-pulls 400 --json "$OUT/bench-latency-$run.json" 2>&1 \
    | sed -n '/^small-request/,$p' | tail -8
done
for blocks in 16 512; do
  step "timeline, $blocks-block KERNEL pulls"
  rm -rf "/tmp/tl-$blocks" && mkdir -p "/tmp/tl-$blocks"
  KVX_TIMELINE_DIR=/tmp/tl-$blocks PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH \
    timeout 120 python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 \
    --blocks "$blocks" --pulls "$([ "$blocks" = 16 ] && echo 2000 || echo 400)" 2>&1 | tail -3
  python3 -m bench.timeline_report "/tmp/tl-$blocks" > "$OUT/timeline-$blocks.txt" 2>&1
  grep -v "_get_notifs\|#[2-9]" "$OUT/timeline-$blocks.txt" | head -60
done
step "done"
