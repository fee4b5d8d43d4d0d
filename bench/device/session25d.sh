#!/usr/bin/env bash
# Session 25, call 4: the bench's KERNEL rows (1 GiB of random blocks, and the 16-block latency
# rows) at the session's start (_base: 13b987d) and at this tree, alternating, two rounds on
# one machine: what this session's changes (the owner's prompt READ_DONE polls, the copy_group
# launch's 32 KB parameters) did to the bench's own figures.
#   rm -rf _base && mkdir _base && git archive 13b987d kvxferd cuda bench | tar -x -C _base
#   carry: [".whl", "_base"]
. bench/device/env.sh
ROOT=$PWD
machine
build_kernels
build_base
for round in 1 2; do
  for side in base new; do
    dir=$ROOT; [ "$side" = base ] && dir=$ROOT/_base
    step "bench, kernel, 1 GiB random + latency rows: $side, round $round"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 120 python3 -m kvxferd bench --device cuda \
      --sizes 256,8192 --patterns fragmented --strategy kernel --repeat 5 --latency-pulls 200 \
      --json "$OUT/bench-$side-$round.json" 2>&1 \
      | grep -E "^  +(256|8192) +fragmented +(naive|kvxferd)|StartPull with wait \(scheduler|control floor, scheduler|released|^result")
  done
done
step "done"
