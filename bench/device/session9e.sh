#!/usr/bin/env bash
# Last call of session 9: every gpu test at the session's final code (the copy ops' shared
# upload and dispatch came after the measuring calls).
. bench/device/env.sh
machine
build_kernels
TESTS_S=${TESTS_S:-300} gpu_tests all tests
step "done"
