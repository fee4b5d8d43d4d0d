#!/usr/bin/env bash
# Session 16, fourth call: the launch's host cost in a daemon's conditions
# (bench/studies/launch_cost.py: caches cooled between calls, a NIXL agent running beside it).
. bench/device/env.sh
machine
build_kernels
step "launch cost, part by part"
timeout 200 python3 -m bench.studies.launch_cost
step "done"
