#!/usr/bin/env bash
# Session 17, third call: every gpu test at main (the code of 04aac15: the armed launches were
# reverted), the bench's KERNEL table, and what waking another thread costs on this host (the
# armed launch's hand-off to its worker took ~50 us of the event loop in call 2).
. bench/device/env.sh
machine
build_kernels
TESTS_S=330 gpu_tests "all" tests
step "waking another thread: a threading.Event ping-pong, and a pipe"
timeout 60 python3 - <<'PY'
import os, statistics, threading, time
n = 3000
ping, pong = threading.Event(), threading.Event()
def echo():
    for _ in range(n):
        ping.wait(); ping.clear(); pong.set()
t = threading.Thread(target=echo); t.start()
rt, setc = [], []
for _ in range(n):
    t0 = time.perf_counter(); ping.set(); t1 = time.perf_counter(); pong.wait(); pong.clear()
    rt.append(time.perf_counter() - t0); setc.append(t1 - t0)
t.join()
print(f"threading.Event round trip p50 {statistics.median(rt)*1e6:.1f} us, set() alone p50 {statistics.median(setc)*1e6:.1f} us")
r1, w1 = os.pipe(); r2, w2 = os.pipe()
def echo2():
    for _ in range(n):
        os.read(r1, 1); os.write(w2, b"x")
t = threading.Thread(target=echo2); t.start()
rt, wc = [], []
for _ in range(n):
    t0 = time.perf_counter(); os.write(w1, b"x"); t1 = time.perf_counter(); os.read(r2, 1)
    rt.append(time.perf_counter() - t0); wc.append(t1 - t0)
t.join()
print(f"pipe round trip p50 {statistics.median(rt)*1e6:.1f} us, write() alone p50 {statistics.median(wc)*1e6:.1f} us")
PY
step "bench, KERNEL"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench.json" 2>&1 | tail -24
step "done"
