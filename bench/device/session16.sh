#!/usr/bin/env bash
# Session 16, first call: where a 16-block KERNEL pull's time goes on the decode daemon's thread
# (bench/timeline_hook: a stamp at each step; python -m bench.timeline_report lines them up).
# Output: $OUT/timeline.txt, $OUT/cp-timeline.json.
. bench/device/env.sh
machine
build_kernels
step "control path, decode daemon stamped"
mkdir -p /tmp/tl
PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH KVX_TIMELINE_DIR=/tmp/tl timeout 150 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --json "$OUT/cp-timeline.json"
python3 -m bench.timeline_report /tmp/tl | tee "$OUT/timeline.txt"
step "control path, no stamps"
timeout 150 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --json "$OUT/cp-plain.json"
step "done"
