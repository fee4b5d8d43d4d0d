#!/usr/bin/env bash
# Session 26, call 4: the bench's 1 GiB KERNEL row by session
# 25's method (_base, 45aa34f) and this tree's, alternating, on another machine.
#   rm -rf _base && mkdir _base && git archive 45aa34f kvxferd cuda bench | tar -x -C _base
#   carry: [".whl", "_base"]
. bench/device/env.sh
ROOT=$PWD
machine
build_kernels

perrep() { python3 -c "
import json,sys
r=json.load(open(sys.argv[1]))['rows'][0]
print('  ms by rep:', ' '.join(f'{x:.2f}' for x in r['kvxferd']['ms']), '| x naive', round(r['kvxferd_vs_naive'],1))" "$1"; }
for round in 1 2; do
  for side in base new; do
    dir=$ROOT; [ $side = base ] && dir=$ROOT/_base
    step "bench, kernel, 1 GiB random: $side, round $round"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 100 python3 -m kvxferd bench --device cuda \
      --sizes 8192 --patterns fragmented --strategy kernel --repeat 10 --latency-pulls 1 \
      --json "$OUT/bench-$side-$round.json" 2>&1 | grep -E "kvxferd kernel: |naive \(1|^result")
    perrep "$OUT/bench-$side-$round.json"
  done
done
step "done"
