#!/usr/bin/env bash
# Session 15, first call: the planner's plain route (kvxferd/blocks/route.py) through the
# daemons. The gpu tests of the planner's users (IPC, kernels, blocks); _base (the previous main)
# and this tree alternating per round (ROUNDS, default "1 2"), 16-block KERNEL pulls on cuda:0;
# then the decode daemon of this tree sampled with py-spy (--gil) during 10,000 pulls (collapsed
# stacks: $OUT/spy-decode.txt; summarise with python -m bench.spy_report).
. bench/device/env.sh
machine
build_kernels
[ "${GPU_TESTS:-1}" = 1 ] && TESTS_S=120 gpu_tests "ipc, kernels, blocks" tests/ipc tests/kernels tests/blocks
ROUNDS=${ROUNDS:-1 2} control_ab ""
spy_decode
step "done"
