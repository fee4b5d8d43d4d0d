#!/usr/bin/env bash
# Session 15, first call: the planner's plain route (kvxferd/blocks/route.py) through the
# daemons. The gpu tests of the planner's users (IPC, kernels, blocks); _base (the previous main)
# and this tree alternating per round (ROUNDS, default "1 2"), 16-block KERNEL pulls on cuda:0;
# then the decode daemon of this tree sampled with py-spy (--gil) during 10,000 pulls (collapsed
# stacks: $OUT/spy-decode.txt; summarise with python -m bench.spy_report).
. bench/device_env.sh
SPY=/tmp/site/bin/py-spy
machine
build_kernels
[ "${GPU_TESTS:-1}" = 1 ] && TESTS_S=120 gpu_tests "ipc, kernels, blocks" tests/ipc tests/kernels tests/blocks
ROUNDS=${ROUNDS:-1 2} control_ab ""
step "control path with the decode daemon sampled"
timeout 150 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${SPY_PULLS:-10000}" --json "$OUT/cp-prof.json" > "$OUT/cp-prof.log" 2>&1 &
cp=$!
for _ in $(seq 240); do pgrep -f "decode.sched.sock" > /dev/null && break; sleep 0.5; done
sleep "${SETTLE_S:-20}"
dec=$(pgrep -f "decode.sched.sock" | head -1)
"$SPY" record --nonblocking --gil -r 2000 -d "${SPY_S:-8}" -f raw -p "$dec" \
  -o "$OUT/spy-decode.txt" > "$OUT/spy.log" 2>&1
echo "py-spy rc=$? ($(wc -l < "$OUT/spy-decode.txt") stacks)"
wait $cp
cat "$OUT/cp-prof.log"
step "done"
