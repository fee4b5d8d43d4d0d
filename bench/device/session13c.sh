#!/usr/bin/env bash
# Session 13, last call: (1) where a lease confirmation's time goes on the GPU host: 16-block
# KERNEL pulls through bench.control_path with bench/trace_hook stamping both daemons, read by
# bench.trace_report; (2) the bench table at the session's code against the previous main
# (_base), one round each, as bench/device/session12c.sh.
. bench/device/env.sh
machine
build_kernels
step "control path with the confirmation traced (this tree)"
mkdir -p "$OUT/trace"
KVX_TRACE_DIR=$OUT/trace PYTHONPATH=$PWD/bench/trace_hook:$PYTHONPATH timeout 120 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 --pulls 2000 \
  --json "$OUT/cp-traced.json"
python3 -m bench.trace_report "$OUT/trace"
step "kvxferd bench, KERNEL: base, then new"
ROUNDS=1 STRATEGIES=kernel PATTERNS=fragmented,contiguous OUT=$OUT bash bench/device/ab.sh
step "done"
