#!/usr/bin/env bash
# Session 19, call 1: why DIRECT's data plane on one GPU host costs ~0.55-0.7 ms more than the
# bare-NIXL floor's READ of the same descriptors (docs/benchmarks.md, "Session 18").
# 1. bench.studies.direct_engine_floor: the floor's loop against the TransferEngine (with and
#    without the notification pump every daemon runs), one process pair, no daemons;
# 2. the bench's DIRECT rows as shipped (transfer.cuda_ipc = true: the decode daemon also maps
#    the owner's regions over CUDA IPC for KERNEL);
# 3. the same with transfer.cuda_ipc = false in both daemons (no kvxferd mapping beside UCX's
#    own cuda_ipc mapping of the same allocations).
. bench/device/env.sh
machine
step "probe: floor loop against the TransferEngine, 1 GiB contiguous"
timeout 120 python3 -m bench.studies.direct_engine_floor --device cuda:0 --repeat 9 2>&1 \
  | grep -v '^\[' | tail -10
for ipc in true false; do
  step "bench, direct, transfer.cuda_ipc=$ipc"
  KVXFERD_TRANSFER_CUDA_IPC=$ipc timeout 200 python3 -m kvxferd bench --device cuda \
    --sizes 256,8192 --patterns fragmented,contiguous --strategy direct --repeat 3 \
    --latency-pulls 200 --json "$OUT/bench-direct-ipc-$ipc.json" 2>&1 | tail -24
done
step "done"
