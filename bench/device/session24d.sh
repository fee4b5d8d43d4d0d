#!/usr/bin/env bash
# Session 24, call 4: every gpu test at the session's last code (busy polling on: 16 CPUs), the
# bench's latency rows twice at the defaults and once with busy polling off, and one more round
# of the control path off and auto.
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "session 24" tests
for run in 1 2; do
  step "bench, kernel latency rows, defaults, run $run"
  timeout 120 python3 -m kvxferd bench --device cuda --sizes 256 --patterns fragmented \
    --strategy kernel --repeat 1 --latency-pulls 400 --json "$OUT/bench-latency-$run.json" 2>&1 \
    | grep -E "^daemons:|StartPull with wait \(scheduler|control floor, scheduler|^result"
done
step "bench, kernel latency rows, server.busy_poll = off"
KVXFERD_SERVER_BUSY_POLL=off timeout 120 python3 -m kvxferd bench --device cuda --sizes 256 \
  --patterns fragmented --strategy kernel --repeat 1 --latency-pulls 400 \
  --json "$OUT/bench-latency-off.json" 2>&1 \
  | grep -E "^daemons:|StartPull with wait \(scheduler|control floor, scheduler|^result"
for mode in off auto; do
  step "control path: server.busy_poll = $mode"
  KVXFERD_SERVER_BUSY_POLL=$mode timeout 100 python3 bench/control_path.py --device cuda \
    --pool dense:num_blocks=600 --pulls 2000 --json "$OUT/cp-$mode-3.json" 2>&1 | head -1
done
step "done"
