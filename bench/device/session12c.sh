#!/usr/bin/env bash
# Session 12, last call: the bench table at the session's final code against the previous main
# (_base, as bench/device/session12.sh), alternating on one machine: `kvxferd bench` KERNEL rows
# (16-block latency on the scheduler socket, 32 MiB and 1 GiB random and contiguous) through
# bench/device/ab.sh, then 1 GiB pulls (512 random blocks) through bench.control_path.
. bench/device/env.sh
machine
build_kernels
step "kvxferd bench, KERNEL: base, then new"
ROUNDS=1 STRATEGIES=kernel PATTERNS=fragmented,contiguous OUT=$OUT bash bench/device/ab.sh
ROUNDS=1 control_ab big- --blocks 512 --pulls 200 --warmup 20
step "done"
