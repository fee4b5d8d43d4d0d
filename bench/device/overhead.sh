#!/usr/bin/env bash
# One call on the lent GPU machine for issue 14 (per-pull overhead) and a final GPU test run:
# every `gpu` test of the suite, the 16-block latency per strategy with the daemon's per-stage
# times, and 1 GiB DIRECT pulls under NIXL settings (UCX worker threads, progress delay) set
# through KVXFERD_NIXL_* in the daemons' environment. Carry .whl/ as bench/device/session.sh
# says. Each step is time-boxed; the short table is last.
. bench/device/env.sh
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels"
timeout 240 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

step "every gpu-marked test"
timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/tests-gpu.log" 2>&1
tail -5 "$OUT/tests-gpu.log"

step "16-block latency and 1 GiB, DIRECT and KERNEL, per-stage times"
timeout 170 python3 -m kvxferd bench --device cuda --sizes 256,8192 --patterns fragmented \
  --strategy direct,kernel --repeat 3 --latency-pulls 100 --json "$OUT/bench-overhead.json" \
  > "$OUT/bench-overhead.log" 2>&1
sed -n '/^tokens /,$p' "$OUT/bench-overhead.log" | tail -25

for setting in "NUM_THREADS=0" "NUM_THREADS=4" "PROGRESS_DELAY_US=0"; do
  step "1 GiB DIRECT with KVXFERD_NIXL_$setting"
  env "KVXFERD_NIXL_$setting" timeout 110 python3 -m kvxferd bench --device cuda --sizes 8192 \
    --patterns fragmented,contiguous --strategy direct --repeat 3 --latency-pulls 30 \
    --json "$OUT/bench-nixl-${setting%%=*}-${setting##*=}.json" > "$OUT/nixl-$setting.log" 2>&1
  grep -E "kvxferd direct|floor|latency" "$OUT/nixl-$setting.log" | tail -6
done
step "done"
