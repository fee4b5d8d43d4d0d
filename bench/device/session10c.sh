#!/usr/bin/env bash
# Session 10, third call: the stream test again (its first upload now warmed), then py-spy on
# both daemons during 16-block KERNEL pulls on the scheduler socket (where each daemon's loop
# spends a pull), the profiles archived for the aggregation in docs/benchmarks.md.
. bench/device/env.sh
machine
build_kernels
TESTS_S=120 gpu_tests "the stream test" tests/ipc/test_gpu.py -k "stream_passed or group"
SPY=/tmp/site/bin/py-spy
[ -x "$SPY" ] || SPY=$(ls /tmp/site/py_spy*/../bin/py-spy 2>/dev/null | head -1)
step "bench: kernel 16-block pulls, py-spy on both daemons"
log="$OUT/prof.log"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256 --patterns fragmented \
  --strategy kernel --repeat 2 --latency-pulls "${PULLS:-1500}" --no-verify \
  --json "$OUT/prof.json" > "$log" 2>&1 &
bench=$!
for _ in $(seq 400); do grep -q "latency  " "$log" && break; sleep 0.25; done
sleep 1
dec=$(pgrep -f "transfer.strategy=kernel" | head -1)
pre=$(pgrep -f "prefill.ready.json" | head -1)
"$SPY" record --nonblocking -r 2000 -d 8 -f raw -p "$dec" -o "$OUT/spy-decode.txt" >/dev/null 2>&1 &
"$SPY" record --nonblocking -r 2000 -d 8 -f raw -p "$pre" -o "$OUT/spy-prefill.txt" >/dev/null 2>&1
wait
grep -A14 "small-request" "$log" | grep -E "StartPull|stages|floor"
(cd "$OUT" && tar czf profiles.tgz spy-*.txt prof.log prof.json && rm -f spy-*.txt prof.json)
step "done"
