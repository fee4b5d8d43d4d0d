#!/usr/bin/env bash
# Session 21, calls 2, 3 and 5: every gpu test at the session's last code (call 2: the detach lets go of its
# closed staging before dropping memory, invalid blocks as logical IDs, the owner-side fixes;
# call 3: a READ only to the owner instance that granted its share, the planner's refusals;
# call 5: the hostile-input fixes: preset layer cap, shm names, tokens).
. bench/device/env.sh
machine
build_kernels
TESTS_S=300 gpu_tests "session 21, last code" tests
step "done"
