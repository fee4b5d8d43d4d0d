#!/usr/bin/env bash
# Session 25, call 2: every gpu test at this tree (the copy_group launch without a stream guard
# and with the SM and device counts asked once, cuda/copy_ranges.cu; the READ_DONE sent before
# the pull's books), then 16-block KERNEL pulls of the control path, _base (fecf8ea: before both)
# against this tree, alternating, two rounds; then this tree's timelines.
#   rm -rf _base && mkdir _base && git archive fecf8ea kvxferd cuda bench | tar -x -C _base
#   carry: [".whl", "_base"]
. bench/device/env.sh
machine
build_kernels
build_base
TESTS_S=300 gpu_tests "session 25, call 2" tests
ab_own cp16 4 --pool dense:num_blocks=600 --pulls 2000
timelines16 "answer_in>|cuda_run_copy|wait_event<|StartPull<|settle|send_notif>"
step "done"
