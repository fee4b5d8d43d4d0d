#!/usr/bin/env bash
# Session 14, first call: every gpu test at the session's code, then _base (the previous main)
# and this tree alternating per round (ROUNDS, default "1 2 3") through the daemons, 16-block
# KERNEL pulls on cuda:0; then 512-block (1 GiB) pulls (BIG_ROUNDS, default "1 2").
. bench/device/env.sh
machine
build_kernels
[ "${GPU_TESTS:-1}" = 1 ] && TESTS_S=280 gpu_tests "every gpu test" tests
ROUNDS=${ROUNDS:-1 2 3} control_ab ""
ROUNDS=${BIG_ROUNDS:-1 2} PULLS=${BIG_PULLS:-300} control_ab big --blocks 512
step "done"
