#!/usr/bin/env bash
# Session 21, call 2: every gpu test at the session's last code (the detach lets go of its
# closed staging before dropping memory; invalid blocks as logical IDs; the owner-side fixes).
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "session 21, last code" tests
step "done"
