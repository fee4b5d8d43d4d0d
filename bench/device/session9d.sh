#!/usr/bin/env bash
# Fourth call of session 9: the grouped copy running 1 GiB pulls inline. Build, every gpu test,
# the KernelReader-only bench, then `kvxferd bench` 1 GiB cells with py-spy (every thread) on
# the decode daemon, to see where a big pull's transfer stage goes beyond KernelReader.pull.
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-260} gpu_tests all tests
step "bench.ipc_kernel"
timeout 200 python3 -m bench.ipc_kernel --caps 0,64 --repeat 10 --pulls 300 \
  --json "$OUT/ipc.json" > "$OUT/ipc.log" 2>&1
echo "ipc rc=$?"
grep -E "^pull" "$OUT/ipc.log" | tail -12
SPY=/tmp/site/bin/py-spy
step "bench: kernel 1 GiB cells, py-spy --threads on the decode daemon"
(for i in $(seq 1 600); do p=$(pgrep -f "transfer.strategy=kernel" | head -1)
   [ -n "$p" ] && break; sleep 0.2; done
 "$SPY" record -p "$p" -r 2000 -f raw --threads -o "$OUT/spy-decode.txt" --nonblocking \
   > "$OUT/spy-decode.log" 2>&1) &
timeout 150 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 20 --latency-pulls 100 \
  --json "$OUT/bench-kernel.json" > "$OUT/bench-kernel.log" 2>&1
echo "bench rc=$?"
wait
sed -n '/^tokens/,$p' "$OUT/bench-kernel.log" | grep -v "^raw copy:" | tail -24
step "done"
