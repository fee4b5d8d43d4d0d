#!/usr/bin/env bash
# One call on the lent GPU machine for issue 13's second pass (the KERNEL pull's speed): build
# the kernels, the KERNEL copy alone and whole KernelReader pulls, old vs new kernel in the same
# run (bench/ipc_kernel.py), the one-table bench through two daemons (raw and naive rows in the
# same run), the GPU tests of tests/ipc and tests/kernels; the short table is last.
#
# Run from the root of the tree under test, with the wheels the machine lacks in $WHL (default
# .whl; fetch them as the header of bench/device/session.sh says). STEPS picks the steps
# (default "build ipc bench tests"); each is time-boxed so the whole call ends inside 10 minutes;
# full logs and JSON are written under $OUT.
set -u
OUT=${OUT:-/tmp/kvxferd-device}
WHL=${WHL:-.whl}
STEPS=${STEPS:-build ipc bench tests}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHL"/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
step() { echo; echo "== $1 ($(date -u +%T))"; }
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

if has build; then
  step "build the CUDA kernels (staging + copy_ranges)"
  timeout 200 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"
fi

if has ipc; then
  step "KERNEL copy alone and KernelReader pulls, stride vs CTA-per-piece (bench/ipc_kernel.py)"
  timeout "${IPC_S:-150}" python3 -m bench.ipc_kernel --json "$OUT/ipc.json" \
    > "$OUT/ipc.log" 2>&1
  echo "ipc_kernel exit $?"
  sed -n '/^row /,$p' "$OUT/ipc.log"
  grep -E "p50 .* ms p99" "$OUT/ipc.log" | head -12
fi

if has bench; then
  step "kvxferd bench: raw, naive, floor, KERNEL, DIRECT, auto (both daemons on cuda:0)"
  timeout "${BENCH_S:-190}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
    --patterns fragmented,contiguous --strategy kernel,direct,auto --repeat 5 \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench exit $?"
  sed -n '/^tokens /,$p' "$OUT/bench.log" | grep -v "^raw copy: torch"
fi

if has tests; then
  step "GPU tests: pytest -m gpu tests/ipc tests/kernels"
  timeout "${TESTS_S:-160}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/ipc \
    tests/kernels > "$OUT/tests.log" 2>&1
  echo "pytest exit $?"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -8
fi

step "short table"
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
if (out / "ipc.json").exists():
    d = json.loads((out / "ipc.json").read_text())
    print(f"raw copy (bench/ipc_kernel): {d['raw_gbps']:.0f} GB/s")
    for r in d["rows"]:
        if "imported" in r["row"] and "cap=0" in r["row"] or r["row"].startswith("pull"):
            p = f" p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f}" if "p50_ms" in r else ""
            print(f"  {r['row']:52s} {r['gbps']:8.1f} GB/s {r['x_raw']:.2f} x raw{p}")
if (out / "bench.json").exists():
    d = json.loads((out / "bench.json").read_text())
    for r in d["rows"]:
        k = r.get("kvxferd") or {}
        lim = r.get("limit") or {}
        print(
            f"  bench {r['tokens']:5d} {r['pattern']:10s} {(r.get('strategy') or {}).get('ran', '?'):7s}"
            f" {k.get('median_gbps', 0):8.1f} GB/s x raw {r.get('kvxferd_vs_limit', 0):.3f}"
            f" x naive {r.get('kvxferd_vs_naive', 0):.1f} (raw {lim.get('median_gbps', 0):.0f})"
        )
    lat = d.get("latency") or {}
    if lat:
        print(f"  16-block p50 {lat['p50_ms']:.2f} ms p99 {lat['p99_ms']:.2f} ms"
              f" stages {lat.get('stages_p50_ms')}")
EOF
step "done"
