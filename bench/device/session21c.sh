#!/usr/bin/env bash
# Session 21, call 4, on nvidia-h200-x2 (two H200s over NVLink): every gpu test at the
# session's last code, on the topology issue 17 asks about (session 20's nvlink.sh measured it).
. bench/device/env.sh
machine
nvidia-smi topo -m 2>&1 | head -4
build_kernels
TESTS_S=280 gpu_tests "session 21, two GPUs" tests
step "done"
