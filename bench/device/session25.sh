#!/usr/bin/env bash
# Session 25, call 1: every gpu test at this tree (the copy_group launch taking tables of up to
# 4,000 values as its parameter, cuda/copy_ranges.cu; the owner's prompt READ_DONE polls), then
# 512-block KERNEL pulls back to back (1 GiB of random blocks, bench.control_path), _base (the
# tree before the launch change: git archive of kvxferd, cuda and bench at its commit) against
# this tree, alternating, two rounds; then this tree's 16-block pulls with the release after the
# answer (WatchReleases) and both daemons' timelines.
#   rm -rf _base && mkdir _base && git archive HEAD kvxferd cuda bench | tar -x -C _base
#   carry: [".whl", "_base"]
. bench/device/env.sh
machine
build_kernels
build_base
TESTS_S=300 gpu_tests "session 25" tests
ab_own cp512 3 --pool dense:num_blocks=1200 --blocks 512 --pulls 300 --warmup 50
step "control path, 16 blocks, this tree"
timeout 100 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls 2000 --json "$OUT/cp16.json" 2>&1 | tail -4
timelines16 "frame_in>|plan>|owner:serve<|answer_in>|cuda_run_copy|wait_event<|StartPull<|send_notif>|owner:nixl_call:_get_notifs"
step "done"
