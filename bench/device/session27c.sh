#!/usr/bin/env bash
# Session 27, call 3: is the host work's spread between runs the work between pulls, or how busy
# the rest of the machine is? bench.host_work in three interleaved rounds, each kind of work
# between pulls alone and beside $SPIN busy-looping processes on the other CPUs; then the control
# path's 16-block pulls alone and beside them, alternating.
#   carry: [".whl"]
. bench/device/env.sh
machine
SPIN=${SPIN:-4}
hw() { timeout 60 taskset -c 0 python3 -m bench.host_work --calls 1500 --between "$1" 2>&1 | tail -5 | tr -s ' ' | tr '\n' ' '; echo; }
spinners() { for i in $(seq "$SPIN"); do taskset -c $((i + 1)) python3 -c "while True: pass" & done; sleep 1; }
for round in 1 2 3; do
  step "host work, round $round: alone"
  for b in none spin:500 thrash:8; do hw $b; done
  step "host work, round $round: beside $SPIN spinning processes"
  spinners
  for b in none spin:500 thrash:8; do hw $b; done
  pkill -f "while True: pass"; wait 2>/dev/null
done
build_kernels
for round in 1 2; do
  for side in alone beside; do
    step "control path, 16 blocks, round $round: $side"
    [ $side = beside ] && { SPIN=3; spinners; }
    timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 --pulls 1500 \
      --json "$OUT/cp16-$side-$round.json" 2>&1 | head -2
    pkill -f "while True: pass"; wait 2>/dev/null
  done
done
