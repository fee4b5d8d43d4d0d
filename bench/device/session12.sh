#!/usr/bin/env bash
# Session 12 on the lent GPU machine: (1) the host's CPU as the daemons meet it (model, idle
# states, frequency governor) and the planner's hot cost there; (2) an A/B of the per-pull cost,
# _base (git archive of the previous main: kvxferd bench cuda pyproject.toml) against the working
# tree, alternating, bench.control_path on cuda:0; (3) whether the daemons are slowed by their
# cores idling between pulls: the same measurement with client and daemons pinned to four cores,
# without and with a SCHED_IDLE spinner on each of those cores (it runs only when nothing else
# wants the core, so it keeps the cores out of their idle states without taking time from the
# daemons). GPU_TESTS=1 first runs every gpu test; ROUNDS, PULLS as in session11.sh.
. bench/device/env.sh
machine
lscpu | grep -E "Model name|^CPU\(s\)|MHz|NUMA node\(s\)" || true
for f in /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor; do
  echo "$f: $(cat "$f" 2>/dev/null || echo absent)"
done
ls /sys/devices/system/cpu/cpu0/cpuidle 2>/dev/null | tr '\n' ' '; echo
build_kernels
[ "${GPU_TESTS:-0}" = 1 ] && TESTS_S=260 gpu_tests "every gpu test" tests
ROOT=$PWD
step "planning a 16-block pull, hot (llama-shaped pool, CPU tensors): base, new"
for dir in "$ROOT/_base" "$ROOT"; do
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 - <<'PY'
import statistics, time
import numpy as np
from kvxferd.blocks import plan_pull
from kvxferd.layout import preset
spec = preset("dense:num_blocks=600")
rng = np.random.default_rng(0)
cases = [([rng.choice(600, 16, replace=False).tolist()], [rng.choice(600, 16, replace=False).tolist()]) for _ in range(64)]
for lo, re in cases:
    plan_pull(spec, spec, lo, re, prefix_caching=True)
ts = []
for i in range(4000):
    lo, re = cases[i % 64]
    t = time.perf_counter(); plan_pull(spec, spec, lo, re, prefix_caching=True); ts.append(time.perf_counter() - t)
print(f"  plan_pull p50 {statistics.median(ts) * 1e6:.1f} us")
PY
  )
done
control_ab ""
if [ "${SPIN:-1}" = 1 ]; then
  CORES=${CORES:-2-5}
  for run in pinned spinners pinned2 spinners2; do
    pids=()
    if [[ $run == spinners* ]]; then
      for c in $(seq ${CORES%-*} ${CORES#*-}); do
        chrt -i 0 taskset -c "$c" python3 -c "while True: pass" & pids+=($!)
      done
    fi
    step "control path, everything on cores $CORES: $run"
    taskset -c "$CORES" timeout 120 python3 bench/control_path.py --device cuda \
      --pool dense:num_blocks=600 --pulls "${PULLS:-2000}" --json "$OUT/cp-$run.json"
    [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" && wait "${pids[@]}" 2>/dev/null
  done
fi
step "done"
