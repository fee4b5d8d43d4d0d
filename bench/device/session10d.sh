#!/usr/bin/env bash
# Session 10, fourth call: A/B of this session's KERNEL changes against the previous main
# (_base = 6404ace), three rounds alternating on one warm machine (bench/device/ab.sh).
. bench/device/env.sh
machine
build_kernels
(cd _base && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -c \
  "from kvxferd.kernels import active_backend as a; print('base', a().describe())")
step "A/B against _base"
ROUNDS=${ROUNDS:-1 2 3} STRATEGIES=kernel OUT=$OUT/ab bash bench/device/ab.sh
for f in "$OUT"/ab/*.log; do
  echo "== $f"; grep -A14 "small-request" "$f" | grep -E "scheduler socket\)|stages p50" | tail -2
done
step "done"
