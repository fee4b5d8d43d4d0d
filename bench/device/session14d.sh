#!/usr/bin/env bash
# Session 14, fourth call: every gpu test at the session's last code.
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "every gpu test" tests
step "done"
