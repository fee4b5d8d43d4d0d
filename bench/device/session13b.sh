#!/usr/bin/env bash
# Session 13, second call: every gpu test at the session's code, then three ways through the
# daemons, alternating per round (ROUNDS, default "1 2"): _base (the previous main), this tree,
# and this tree with eager task starts turned off (bench/lazy_hook), 16-block KERNEL pulls on
# cuda:0; then _base and this tree on 512-block (1 GiB) pulls (BIG_ROUNDS, default "2").
. bench/device/env.sh
machine
build_kernels
[ "${GPU_TESTS:-1}" = 1 ] && TESTS_S=280 gpu_tests "every gpu test" tests
for r in ${ROUNDS:-1 2}; do
  ROUNDS=$r control_ab ""
  ROUNDS=$r control_lazy ""
done
ROUNDS=${BIG_ROUNDS:-2} PULLS=${BIG_PULLS:-300} control_ab big --blocks 512
step "done"
