#!/usr/bin/env bash
# Session 26, call 3: the bench's new method (3 untimed pulls of distinct blocks per size, the
# last timed pull verified) against session 25's (one untimed pull, the first verified): the
# 1 GiB KERNEL row, _base (45aa34f) and this tree alternating, two rounds, rep by rep; then
# this tree's table and 512-block pulls back to back.
#   rm -rf _base && mkdir _base && git archive 45aa34f kvxferd cuda bench | tar -x -C _base
#   carry: [".whl", "_base"]
. bench/device/env.sh
machine
build_kernels
build_base
bench_ab bench --sizes 8192 --patterns fragmented --strategy kernel --repeat 10 \
  --latency-pulls 1
step "bench table, this tree"
timeout 300 python3 -m kvxferd bench --device cuda --sizes 256,8192 --patterns fragmented,contiguous \
  --strategy kernel,direct --repeat 5 --latency-pulls 200 --json "$OUT/bench-table.json" 2>&1 | tail -32
step "control path, 512 blocks back to back"
timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 --blocks 512 \
  --pulls 300 --warmup 30 --json "$OUT/cp512.json" 2>&1 | head -2
step "done"
