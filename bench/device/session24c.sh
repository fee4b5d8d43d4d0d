#!/usr/bin/env bash
# Session 24, call 3: busy polling (server.busy_poll, kvxferd/busypoll.py) through the daemons.
# 16-block KERNEL pulls of the control path with busy polling off and at its default (auto: on
# with 16 CPUs), alternating, two rounds; the daemons' idle CPU with it on; then the bench table
# (KERNEL and DIRECT) at the defaults.
. bench/device/env.sh
machine
build_kernels
for round in 1 2; do
  for mode in off auto; do
    step "control path: server.busy_poll = $mode, round $round"
    KVXFERD_SERVER_BUSY_POLL=$mode timeout 100 python3 bench/control_path.py --device cuda \
      --pool dense:num_blocks=600 --pulls 2000 --json "$OUT/cp-$mode-$round.json" 2>&1 | tail -3
  done
done
step "idle CPU of both daemons, busy polling auto"
timeout 60 python3 -m bench.idle_daemons --device cuda --seconds 5 2>&1 | tail -2
step "bench, kernel and direct, defaults"
timeout 300 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | sed -n '/^tokens /,$p' | tail -42
step "done"
