#!/usr/bin/env bash
# Session 27, call 5: call 4's 16-block A/B (host work as it is / kept for a repeated request,
# bench/memo_hook) in three more rounds, then the bench's 1 GiB random rows once (naive and
# KERNEL in the same run, for x naive).
#   carry: [".whl"]
. bench/device/env.sh
machine
build_kernels
for round in 3 4 5; do
  control_memo "16-plain-$round" "" --pool dense:num_blocks=600 --pulls 1500
  control_memo "16-memo-$round" bench/memo_hook --pool dense:num_blocks=600 --pulls 1500
done
bench_1g
