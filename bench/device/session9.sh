#!/usr/bin/env bash
# First call of session 9 on the lent GPU machine: where a KERNEL pull's time goes on the GPU
# host. `kvxferd bench` (KERNEL; 16-block latency pulls and 1 GiB cells, every cell's daemon
# stages now in the JSON) with py-spy sampling the decode daemon for the whole run, then the
# KernelReader-only bench (bench/ipc_kernel.py) under py-spy. py-spy comes from .whl/.
. bench/device/env.sh
machine
build_kernels
SPY=/tmp/site/bin/py-spy
[ -x "$SPY" ] || SPY=$(ls /tmp/site/py_spy*/../bin/py-spy 2>/dev/null | head -1)
echo "py-spy: $SPY"

step "bench: kernel, 16 blocks and 1 GiB, py-spy on the decode daemon"
(for i in $(seq 1 600); do p=$(pgrep -f "transfer.strategy=kernel" | head -1)
   [ -n "$p" ] && break; sleep 0.2; done
 echo "decode pid $p"
 "$SPY" record -p "$p" -r 2000 -f raw -o "$OUT/spy-decode.txt" --nonblocking \
   > "$OUT/spy-decode.log" 2>&1) &
timeout "${BENCH_S:-200}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 10 --latency-pulls 300 \
  --json "$OUT/bench-kernel.json" > "$OUT/bench-kernel.log" 2>&1
echo "bench rc=$?"
wait
tail -3 "$OUT/spy-decode.log"
sed -n '/^tokens/,$p' "$OUT/bench-kernel.log" | tail -24

step "bench.ipc_kernel under py-spy (pull rows)"
timeout 200 "$SPY" record -r 2000 -f raw -o "$OUT/spy-ipc.txt" -- python3 -m bench.ipc_kernel \
  --caps 0 --repeat 10 --pulls 300 --json "$OUT/ipc.json" > "$OUT/ipc.log" 2>&1
echo "ipc rc=$?"
grep -iE "pull|raw" "$OUT/ipc.log" | tail -12
step "done"
