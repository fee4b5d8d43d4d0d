#!/usr/bin/env bash
# Session 10, seventh call: the confirmation's answer taken without extra loop turns (the
# local Peer socket awaits it under asyncio.timeout; a pull whose confirmation already
# answered takes it at once) against 433dedc (_base), two rounds alternating
# (bench/device/ab.sh); the gpu tests of ipc and kernels first.
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-150} gpu_tests "ipc and kernels" tests/ipc tests/kernels
step "A/B against _base"
ROUNDS=${ROUNDS:-1 2} STRATEGIES=kernel OUT=$OUT/ab bash bench/device/ab.sh >/dev/null 2>&1
for f in "$OUT"/ab/*.log; do
  echo "== $(basename "$f")"; grep -A14 "small-request" "$f" | grep -E "scheduler socket\)|stages p50" | tail -3
  grep -E "^  8192 .*KERNEL" "$f"
done
rm -f "$OUT"/ab/*.log
step "done"
