#!/usr/bin/env bash
# Session 27, call 4: what a pull costs with the decode daemon's host work at about zero (its
# plan, decision and KERNEL tables kept for a repeated request: bench/memo_hook), the most a
# compiled planner could give. The control path cycles through 8 block-ID lists (--distinct 8)
# on both sides of the A/B, 16- and 512-block pulls, two rounds each, alternating.
#   carry: [".whl"]
. bench/device/env.sh
machine
build_kernels
for round in 1 2; do
  control_memo "16-plain-$round" "" --pool dense:num_blocks=600 --pulls 1500
  control_memo "16-memo-$round" bench/memo_hook --pool dense:num_blocks=600 --pulls 1500
  control_memo "512-plain-$round" "" --pool dense:num_blocks=1200 --blocks 512 --pulls 300 --warmup 30
  control_memo "512-memo-$round" bench/memo_hook --pool dense:num_blocks=1200 --blocks 512 --pulls 300 --warmup 30
done
