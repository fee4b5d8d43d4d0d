#!/usr/bin/env bash
# Session 24, call 1: is the decode daemon's per-pull time its own Python, or where the host
# places its threads? The host work alone (bench.host_work), then 16-block KERNEL pulls with the
# daemons' and the client's threads pinned in several ways (bench/studies/placement.py), each
# with the decode daemon's CPU per pull per thread; and the bench's latency rows once.
. bench/device/env.sh
machine
nproc; lscpu | grep -E "Model name|Thread|Core|Socket|MHz|NUMA node" | head -8
build_kernels
step "host work alone, 16 blocks"
timeout 60 python3 -m bench.host_work --calls 3000 2>&1 | tail -5
step "placement study"
timeout 300 python3 -m bench.studies.placement --device cuda --pool dense:num_blocks=600 \
  --pulls 1000 --json "$OUT/placement.json" 2>&1 | grep -v "^\s*$" | tail -12
step "bench, kernel latency rows"
timeout 150 python3 -m kvxferd bench --device cuda --sizes 256 --patterns fragmented \
  --strategy kernel --repeat 1 --latency-pulls 400 --json "$OUT/bench-latency.json" 2>&1 \
  | sed -n '/^small-request/,$p' | tail -8
step "done"
