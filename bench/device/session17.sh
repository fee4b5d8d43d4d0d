#!/usr/bin/env bash
# Session 17, first call: where the decode daemon's launch spends its ~70 us (py-spy with native
# frames, and the system calls of the decode daemon per pull), and a timeline of both daemons
# (the owner's ConfirmLease stamped): how much of the confirmation's round trip is idle on the
# decode daemon, i.e. how much host work could move before the owner's answer for free.
. bench/device/env.sh
machine
build_kernels
step "timeline of both daemons, 2,000 16-block KERNEL pulls"
mkdir -p /tmp/tl
KVX_TIMELINE_DIR=/tmp/tl PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH timeout 150 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 --pulls 2000 \
  --json "$OUT/cp-timeline.json" | tail -4
python3 -m bench.timeline_report /tmp/tl > "$OUT/timeline.txt" 2>&1; cat "$OUT/timeline.txt"
step "decode daemon: native stacks (py-spy --native, 250 Hz, 10 s) and system calls"
timeout 200 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls 12000 --json "$OUT/cp-native.json" > "$OUT/cp-native.log" 2>&1 &
cp=$!
for _ in $(seq 240); do pgrep -f "decode.sched.sock" > /dev/null && break; sleep 0.5; done
sleep 15
dec=$(pgrep -f "decode.sched.sock" | head -1)
/tmp/site/bin/py-spy record --native -r 250 -d 10 -f raw -p "$dec" -o "$OUT/spy-native.txt" \
  > "$OUT/spy.log" 2>&1
echo "py-spy rc=$? ($(wc -l < "$OUT/spy-native.txt") stacks)"; tail -3 "$OUT/spy.log"
if command -v strace > /dev/null; then
  timeout 8 strace -f -c -p "$dec" -o "$OUT/strace.txt" > /dev/null 2>&1
  head -25 "$OUT/strace.txt"
else
  echo "no strace here"
fi
command -v perf gdb ltrace || true
wait $cp
tail -5 "$OUT/cp-native.log"
step "done"
