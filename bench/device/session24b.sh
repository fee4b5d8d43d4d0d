#!/usr/bin/env bash
# Session 24, call 2: how much of a 16-block KERNEL pull is the host waking idle threads? The
# control path with both daemons' event loops never sleeping (bench/spin_hook, KVX_SPIN=1), only
# the decode daemon's (KVX_SPIN=decode), and neither, alternating; then the decode daemon's
# timeline and the bench's latency rows with both spinning.
. bench/device/env.sh
machine
build_kernels
cp_run() { # LABEL SPIN
  step "control path: $1"
  KVX_SPIN=$2 PYTHONPATH=$PWD/bench/spin_hook:$PYTHONPATH timeout 100 python3 bench/control_path.py \
    --device cuda --pool dense:num_blocks=600 --pulls 2000 --json "$OUT/cp-$1.json" 2>&1 | tail -3
}
cp_run plain-1 ""
cp_run spin-1 1
cp_run plain-2 ""
cp_run spin-2 1
cp_run spin-decode decode
step "timeline, 16-block KERNEL pulls, both spinning"
rm -rf /tmp/tl && mkdir -p /tmp/tl
KVX_SPIN=1 KVX_TIMELINE_DIR=/tmp/tl PYTHONPATH=$PWD/bench/spin_hook:$PWD/bench/timeline_hook:$PYTHONPATH \
  timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 --pulls 2000 2>&1 | tail -3
python3 -m bench.timeline_report /tmp/tl > "$OUT/timeline-spin-16.txt" 2>&1
grep -v "_get_notifs\|#[2-9]" "$OUT/timeline-spin-16.txt" | head -60
step "bench, kernel latency rows, both spinning"
KVX_SPIN=1 PYTHONPATH=$PWD/bench/spin_hook:$PYTHONPATH timeout 150 python3 -m kvxferd bench \
  --device cuda --sizes 256 --patterns fragmented --strategy kernel --repeat 1 --latency-pulls 400 \
  --json "$OUT/bench-latency-spin.json" 2>&1 | sed -n '/^small-request/,$p' | tail -8
step "done"
