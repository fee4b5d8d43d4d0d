#!/usr/bin/env bash
# Session 25, call 3: the bench table at this tree (KERNEL and DIRECT, the defaults: busy
# polling auto), its latency rows once more, and 512-block KERNEL pulls back to back twice.
. bench/device/env.sh
machine
build_kernels
step "bench, kernel and direct, defaults"
timeout 330 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?"
grep -vE "^  (kvxferd|naive|floor|limit) " "$OUT/bench.txt" | tail -45
step "bench, kernel latency rows"
timeout 120 python3 -m kvxferd bench --device cuda --sizes 256 --patterns fragmented \
  --strategy kernel --repeat 1 --latency-pulls 400 --json "$OUT/bench-latency.json" 2>&1 \
  | grep -E "^daemons:|StartPull with wait \(scheduler|control floor, scheduler|released|^result"
for run in 1 2; do
  step "control path, 512 blocks, run $run"
  timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 \
    --blocks 512 --pulls 300 --warmup 50 --json "$OUT/cp512-$run.json" 2>&1 | head -3
done
step "done"
