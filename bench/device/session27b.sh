#!/usr/bin/env bash
# Session 27, call 2: the decode daemon's host work for a 16-block pull (bench.host_work) with
# its caches warm and with each kind of work between pulls (sleep, spin, a buffer written:
# this process's caches evicted), alone and beside the control path's daemons; then the bench
# table at this tree.
#   carry: [".whl"]
. bench/device/env.sh
machine
lscpu | grep -E "^(Thread|Core|Socket|NUMA node\(s\)|L1d|L2|L3)" 2>&1
hw() { timeout 60 python3 -m bench.host_work --calls 1500 --between "$1" 2>&1 | tail -5 | tr -s ' ' | tr '\n' ' '; echo; }
step "host work between pulls"
for b in none sleep:500 spin:500 thrash:2 thrash:8 thrash:32; do hw $b; done
build_kernels
step "host work beside the control path's daemons"
timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 --pulls 6000 \
  --json "$OUT/cp16-beside.json" > "$OUT/cp16-beside.log" 2>&1 &
cp=$!
for _ in $(seq 240); do pgrep -f "decode.sched.sock" > /dev/null && break; sleep 0.5; done
sleep 8
for b in none thrash:8; do hw $b; done
wait $cp; head -2 "$OUT/cp16-beside.log"
step "bench"
timeout 420 python3 -m kvxferd bench --device cuda --sizes 256,8192 --patterns fragmented,contiguous \
  --strategy kernel,direct --repeat 5 --latency-pulls 200 --json "$OUT/bench.json" > "$OUT/bench.txt" 2>"$OUT/bench.err"
echo "bench rc=$?"; tail -40 "$OUT/bench.txt"
