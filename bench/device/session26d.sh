#!/usr/bin/env bash
# Session 26, call 4: the bench's 1 GiB KERNEL row by session
# 25's method (_base, 45aa34f) and this tree's, alternating, on another machine.
#   rm -rf _base && mkdir _base && git archive 45aa34f kvxferd cuda bench | tar -x -C _base
#   carry: [".whl", "_base"]
. bench/device/env.sh
machine
build_kernels
bench_ab bench --sizes 8192 --patterns fragmented --strategy kernel --repeat 10 \
  --latency-pulls 1
step "done"
