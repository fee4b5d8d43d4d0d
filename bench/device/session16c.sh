#!/usr/bin/env bash
# Session 16, third call: what a KERNEL launch costs on the host, part by part
# (bench/studies/launch_cost.py), and the CUDA launch itself for a 3,840-byte parameter against
# an 8-byte one (bench/studies/launch_params.cu).
. bench/device/env.sh
machine
build_kernels
step "launch parameters (CUDA alone)"
nvcc -O2 -arch=sm_90 -o /tmp/launch_params bench/studies/launch_params.cu && /tmp/launch_params
step "launch cost, part by part"
timeout 120 python3 -m bench.studies.launch_cost
step "done"
