#!/usr/bin/env bash
# One call on the lent GPU machine (issue 13): engine-attached IMPORTED VRAM served by KERNEL.
# The gpu tests of tests/attach and tests/ipc, then bench/attached_pull.py (owned vs attached
# vs imported, KERNEL on one GPU). Carry .whl/ (bench/device/session.sh); output under $OUT:
# tests-gpu.log, bench.log, imported.json, and the test daemons' logs (daemon-logs.tgz).
. bench/device/env.sh
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels"
timeout 120 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

step "bench: owned vs engine-attached OWNED vs engine-attached IMPORTED, pulled by KERNEL"
timeout "${BENCH_S:-110}" python3 -m bench.attached_pull --device cuda --repeat 5 \
  --latency-pulls 200 --json "$OUT/imported.json" > "$OUT/bench.log" 2>&1
rc=$?
echo "bench rc=$rc"
sed -n '/^pattern /,$p' "$OUT/bench.log"
[ "$rc" -eq 0 ] || tail -30 "$OUT/bench.log"

step "gpu tests: tests/attach tests/ipc"
timeout "${TESTS_S:-180}" python3 -m pytest -v -m gpu tests/attach tests/ipc -p no:cacheprovider \
  > "$OUT/tests-gpu.log" 2>&1
echo "pytest rc=$?"
grep -E " PASSED| FAILED| ERROR|passed|failed" "$OUT/tests-gpu.log" | tail -45
find /tmp -path '*pytest-of-*' \( -name '*.log' -o -name '*.err' \) -print0 2>/dev/null \
  | tar czf "$OUT/daemon-logs.tgz" --null -T - 2>/dev/null
step "done"
