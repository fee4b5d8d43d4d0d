#!/usr/bin/env bash
# Session 23, call 3: every gpu test at the session's last code (push mode waits for its
# owner's answer; the vLLM connector's fixes do not run here: the machine has no vLLM).
. bench/device/env.sh
machine
build_kernels
TESTS_S=330 gpu_tests "session 23, last code" tests
step "done"
