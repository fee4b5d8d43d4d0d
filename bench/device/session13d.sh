#!/usr/bin/env bash
# Session 13, final call: every gpu test at the session's last code, then _base (the previous
# main) against it through bench.control_path, 16-block KERNEL pulls, alternating (ROUNDS,
# default "1 2").
. bench/device/env.sh
machine
build_kernels
TESTS_S=200 gpu_tests "every gpu test" tests
control_ab ""
step "done"
