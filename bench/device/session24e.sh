#!/usr/bin/env bash
# Session 24, call 5: 512-block (1 GiB of random blocks) KERNEL pulls back to back through the
# daemons (bench.control_path), busy polling off and on, and on with the copy's grid uncapped
# (transfer.kernel_max_ctas = 0): what a warm daemon gives against the bench's single pulls.
. bench/device/env.sh
machine
build_kernels
run512() { # LABEL, then environment assignments
  local label=$1; shift
  step "control path, 512 blocks: $label"
  env "$@" timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 \
    --blocks 512 --pulls 300 --warmup 50 --json "$OUT/cp512-$label.json" 2>&1 | head -2
}
run512 off KVXFERD_SERVER_BUSY_POLL=off
run512 on KVXFERD_SERVER_BUSY_POLL=on
run512 on-uncapped KVXFERD_SERVER_BUSY_POLL=on KVXFERD_TRANSFER_KERNEL_MAX_CTAS=0
step "done"
