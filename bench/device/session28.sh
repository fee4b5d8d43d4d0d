#!/usr/bin/env bash
# Session 28: would a planner that cost nothing bring the bench's 1 GiB row to 100 x naive?
# 512-block pulls of the control path cycling through 8 ID lists (--distinct 8), the decode
# daemon's host work as it is and kept for a repeated request (bench/memo_hook), back to back
# and with 5 ms idle before each pull (the bench's single pulls follow other work), in two
# rounds; then the bench's 1 GiB random rows (naive and KERNEL in one run, for x naive).
#   carry: [".whl"]
. bench/device/env.sh
machine
build_kernels
for round in 1 2; do
  for gap in 0 5; do
    control_memo "512-plain-gap$gap-$round" "" --pool dense:num_blocks=1200 --blocks 512 \
      --pulls 300 --gap-ms $gap
    control_memo "512-memo-gap$gap-$round" bench/memo_hook --pool dense:num_blocks=1200 \
      --blocks 512 --pulls 300 --gap-ms $gap
  done
done
bench_1g
step "summary: 512-block pulls, p50 ms (plan / build / confirm stages)"
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("cp-512-*.json")):
    d = json.loads(p.read_text()); s = d["stages_p50_ms"]
    print(f"{p.stem:26s} p50 {d['p50_ms']:.3f} p99 {d['p99_ms']:.3f}"
          f"  plan {s.get('plan', 0):.3f} build {s.get('build', 0):.3f} confirm {s.get('confirm', 0):.3f}")
EOF
