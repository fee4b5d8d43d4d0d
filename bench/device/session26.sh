#!/usr/bin/env bash
# Session 26, call 1: is the bench's single 1 GiB pulls' slow host work the host's idle CPU
# states? The idle-gap study with and without a 0 µs wake-up latency request
# (bench/studies/idle_wake.py), 512- and 16-block pulls of the control path with and without
# an idle gap before each pull, each with and without the request held, and the bench's 1 GiB
# KERNEL row with and without it (the first with both daemons' timelines).
#   carry: [".whl"]
. bench/device/env.sh
machine
step "idle states"
cat /sys/devices/system/cpu/cpuidle/current_driver 2>&1
paste /sys/devices/system/cpu/cpu0/cpuidle/state*/name /dev/null 2>&1 | head
cat /sys/devices/system/cpu/cpu0/cpuidle/state*/latency 2>&1 | tr '\n' ' '; echo
cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1
ls -la /dev/cpu_dma_latency 2>&1; id -u; nproc; grep -m1 "model name" /proc/cpuinfo
build_kernels
HOLD="python3 -m bench.studies.idle_wake hold 0 --"
step "idle gap study"
python3 -m bench.studies.idle_wake measure
python3 -m bench.studies.idle_wake measure --qos 0
for q in no yes; do
  pre=""; [ $q = yes ] && pre=$HOLD
  for gap in 0 20; do
    step "control path, 512 blocks, gap $gap ms, request $q"
    timeout 100 $pre python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 \
      --blocks 512 --pulls 200 --warmup 30 --gap-ms $gap --json "$OUT/cp512-gap$gap-qos$q.json" 2>&1 | head -2
  done
done
for round in 1 2; do
  for q in no yes; do
    pre=""; [ $q = yes ] && pre=$HOLD
    for gap in 0 20; do
      step "control path, 16 blocks, gap $gap ms, request $q, round $round"
      n=1500; [ $gap = 20 ] && n=300
      timeout 100 $pre python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
        --pulls $n --warmup 100 --gap-ms $gap --json "$OUT/cp16-gap$gap-qos$q-$round.json" 2>&1 | head -3
    done
  done
done
step "bench, kernel, 1 GiB random, timelines, no request"
rm -rf /tmp/tl && mkdir -p /tmp/tl
KVX_TIMELINE_DIR=/tmp/tl PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH timeout 200 \
  python3 -m kvxferd bench --device cuda --sizes 8192 --patterns fragmented --strategy kernel \
  --repeat 10 --latency-pulls 1 --json "$OUT/bench-tl.json" 2>&1 | grep -E "tokens fragmented|^result|raw copy "
python3 -m bench.timeline_report /tmp/tl --cut 'start_pull>' --skip 2 --min-ms 1.2 > "$OUT/timeline-bench-1g.txt" 2>&1
grep -vE "owner:nixl_call|nixl_call:_get_notifs" "$OUT/timeline-bench-1g.txt" | head -40
for q in no yes; do
  pre=""; [ $q = yes ] && pre=$HOLD
  step "bench, kernel, request $q"
  timeout 200 $pre python3 -m kvxferd bench --device cuda --sizes 8192 --patterns fragmented \
    --strategy kernel --repeat 5 --latency-pulls 300 --json "$OUT/bench-qos$q-$RANDOM.json" 2>&1 \
    | grep -E "8192 .*fragmented|stages, 8192|scheduler socket\)|control floor, sched|^result"
done
step "done"
