#!/usr/bin/env bash
# Session 14, second call: where the decode daemon's main thread spends a 16-block KERNEL
# pull, sampled with py-spy (--gil: the thread holding the GIL) while bench.control_path runs
# this tree on cuda:0. Collapsed stacks (py-spy raw format): $OUT/spy-decode.txt.
. bench/device/env.sh
machine
build_kernels
SPY_PULLS=${PULLS:-10000} SETTLE_S=${SETTLE_S:-25} spy_decode
step "done"
