#!/usr/bin/env bash
# Session 19, call 3: every gpu test at the session's last code (the DIRECT pull's
# started_unix_ns taken from its post call, the floor's post timed apart).
. bench/device/env.sh
machine
build_kernels
TESTS_S=330 gpu_tests "session 19" tests
step "done"
