#!/usr/bin/env bash
# Session 27, call 1: why the GPU host runs the daemon's Python ~3x slower per operation than
# the 2-core VM (the interpreter's build, the CPU, the process's speculation controls:
# bench/studies/cpu_probe.py, which also times each control it may turn back on), then the
# control path's 16- and 512-block KERNEL pulls and every gpu test at this tree.
#   carry: [".whl"]
. bench/device/env.sh
machine
step "cpu probe"
python3 -m bench.studies.cpu_probe --rounds 5
build_kernels
step "control path, 16 blocks"
timeout 120 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 --pulls 2000 \
  --json "$OUT/cp16.json" 2>&1 | head -4
step "control path, 512 blocks"
timeout 120 python3 bench/control_path.py --device cuda --pool dense:num_blocks=1200 --blocks 512 \
  --pulls 300 --warmup 30 --json "$OUT/cp512.json" 2>&1 | head -4
TESTS_S=280 gpu_tests "this tree" tests
