#!/usr/bin/env bash
# Session 11: an A/B on one warm machine of the daemons' per-pull cost, _base (prepare it as
# bench/device/ab.sh says) against the working tree, alternating: bench.control_path (16-block
# KERNEL pulls on the scheduler socket, the bench's llama-shaped pool on cuda:0, each daemon's
# CPU per pull), then kvxferd bench's 16-block latency and 32 MiB / 1 GiB random KERNEL rows.
# GPU_TESTS=1 first runs every gpu test; BIG=512 adds 1 GiB pulls. The base side runs this tree's bench/control_path.py
# against its own kvxferd (run from its directory, so its daemons import it too).
. bench/device/env.sh
machine
build_kernels
[ "${GPU_TESTS:-0}" = 1 ] && TESTS_S=260 gpu_tests "every gpu test" tests
# The measurement lives in kvxferd/scenario/control_path.py since this session: give it to an
# older base (it needs only the scenario harness, which the base has).
[ -f _base/kvxferd/scenario/control_path.py ] || cp kvxferd/scenario/control_path.py _base/kvxferd/scenario/
control_ab ""
if [ -n "${BIG:-}" ]; then  # BIG=512: pulls of that many blocks (512: 1 GiB), one run a side
  ROUNDS=1 control_ab big- --blocks "$BIG" --pulls "${BIG_PULLS:-200}" --warmup 20
fi
[ "${BENCH:-1}" = 1 ] && ROUNDS="${BENCH_ROUNDS:-1}" STRATEGIES=kernel OUT=$OUT bash bench/device/ab.sh
step "done"
