#!/usr/bin/env bash
# Session 27, call 4: what a pull costs with the decode daemon's host work at about zero (its
# plan, decision and KERNEL tables kept for a repeated request: bench/memo_hook), the most a
# compiled planner could give. The control path cycles through 8 block-ID lists (--distinct 8)
# on both sides of the A/B, 16- and 512-block pulls, two rounds each, alternating.
#   carry: [".whl"]
. bench/device/env.sh
machine
build_kernels
cp() { # LABEL HOOKDIR ARGS...
  local label=$1 hook=$2; shift 2
  step "control path: $label"
  PYTHONPATH=${hook:+$PWD/$hook:}$PYTHONPATH timeout 120 python3 bench/control_path.py \
    --device cuda --distinct 8 "$@" --json "$OUT/cp-$label.json" 2>&1 | head -2
}
for round in 1 2; do
  cp "16-plain-$round" "" --pool dense:num_blocks=600 --pulls 1500
  cp "16-memo-$round" bench/memo_hook --pool dense:num_blocks=600 --pulls 1500
  cp "512-plain-$round" "" --pool dense:num_blocks=1200 --blocks 512 --pulls 300 --warmup 30
  cp "512-memo-$round" bench/memo_hook --pool dense:num_blocks=1200 --blocks 512 --pulls 300 --warmup 30
done
