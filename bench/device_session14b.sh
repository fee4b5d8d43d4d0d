#!/usr/bin/env bash
# Session 14, second call: where the decode daemon's main thread spends a 16-block KERNEL
# pull, sampled with py-spy (--gil: the thread holding the GIL) while bench.control_path runs
# this tree on cuda:0. Collapsed stacks (py-spy raw format): $OUT/spy-decode.txt.
. bench/device_env.sh
SPY=/tmp/site/bin/py-spy
machine
build_kernels
step "control path with the decode daemon sampled"
timeout 200 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-10000}" --json "$OUT/cp-prof.json" > "$OUT/cp-prof.log" 2>&1 &
cp=$!
for _ in $(seq 240); do pgrep -f "decode.sched.sock" > /dev/null && break; sleep 0.5; done
sleep "${SETTLE_S:-25}"
dec=$(pgrep -f "decode.sched.sock" | head -1)
"$SPY" record --nonblocking --gil -r 2000 -d "${SPY_S:-8}" -f raw -p "$dec" \
  -o "$OUT/spy-decode.txt" > "$OUT/spy.log" 2>&1
echo "py-spy rc=$? ($(wc -l < "$OUT/spy-decode.txt") stacks)"
wait $cp
cat "$OUT/cp-prof.log"
step "done"
