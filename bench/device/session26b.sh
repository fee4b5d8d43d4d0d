#!/usr/bin/env bash
# Session 26, call 2: how many pulls of a size the daemons need before they run at their
# steady pace. 512-block pulls of the control path from its first pull (--warmup 1), pull by
# pull; the bench's 1 GiB KERNEL row after 1 and after 20 untimed pulls (--warmup), rep by rep;
# both with both daemons' timelines (the gc collections stamped too), cut per pull.
#   carry: [".whl"]
. bench/device/env.sh
machine
build_kernels
perpull() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
ms=d['ms'] if 'ms' in d else d['rows'][0]['kvxferd']['ms']
print(' '.join(f'{x:.2f}' for x in ms[:40]))" "$1"; }
each='owner:frame_in>|answer_in>|^gc|prepare<|mark:plan|mark:confirm|wait_event<'
for w in 1 30; do
  step "control path, 512 blocks, warmup $w, timelines"
  rm -rf /tmp/tl && mkdir -p /tmp/tl
  KVX_TIMELINE_DIR=/tmp/tl PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH timeout 100 \
    python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 --blocks 512 \
    --pulls 100 --warmup $w --json "$OUT/cp512-w$w.json" 2>&1 | head -2
  perpull "$OUT/cp512-w$w.json"
  python3 -m bench.timeline_report /tmp/tl --cut 'start_pull>' --skip $((w + 20)) --min-ms 1.2 \
    --each "$each" > "$OUT/timeline-cp512-w$w.txt" 2>&1
  grep -vE "nixl_call" "$OUT/timeline-cp512-w$w.txt" | head -40 | tail -34
  grep -cE "gc[0-9]>" "$OUT/timeline-cp512-w$w.txt"
done
for w in 1 20; do
  step "bench, kernel, 1 GiB random, warmup $w, timelines"
  rm -rf /tmp/tl && mkdir -p /tmp/tl
  KVX_TIMELINE_DIR=/tmp/tl PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH timeout 200 \
    python3 -m kvxferd bench --device cuda --sizes 8192 --patterns fragmented --strategy kernel \
    --repeat 10 --warmup $w --latency-pulls 1 --json "$OUT/bench-w$w.json" 2>&1 \
    | grep -E "8192 .*fragmented|stages, 8192|^result"
  perpull "$OUT/bench-w$w.json"
  python3 -m bench.timeline_report /tmp/tl --cut 'start_pull>' --skip $((w + 1)) --min-ms 1.2 \
    --each "$each" > "$OUT/timeline-bench-w$w.txt" 2>&1
  grep -vE "nixl_call" "$OUT/timeline-bench-w$w.txt" | head -40 | tail -34
  grep -A12 "pull by pull" "$OUT/timeline-bench-w$w.txt"
done
step "done"
