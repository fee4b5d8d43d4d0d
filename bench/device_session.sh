#!/usr/bin/env bash
# One call on the lent GPU machine (issues 6 and 7): GPU tests, then the benches, each table
# printed as it completes and written as JSON under $OUT. Run from the repository root with
# the NIXL and grpc wheels carried in .whl/ (see docs/benchmarks.md for how they are built) (the machine has no
# internet and grpcio 1.84, so the generated code's version guard is lowered on that copy).
set -u
OUT=${OUT:-/tmp/kvxferd-device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
sed -i "s/GRPC_GENERATED_VERSION = '1.85.1'/GRPC_GENERATED_VERSION = '1.0'/" \
  kvxferd/v1/*_pb2_grpc.py /tmp/site/grpc_health/v1/*_pb2_grpc.py \
  /tmp/site/grpc_reflection/v1alpha/*_pb2_grpc.py
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, grpc; print('torch', torch.__version__, 'grpc', grpc.__version__)"

step() { echo; echo "== $1 ($(date -u +%T))"; }

step "GPU tests"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cuda.py tests/nixl/test_agent.py \
  tests/service/test_service_staged_gpu.py tests/attach/test_attach_gpu.py 2>&1 | tail -15

step "kvxferd bench, two GPUs"
python3 -m kvxferd bench --device cuda --sizes "${SIZES:-256,8192}" \
  --patterns fragmented,contiguous --strategy direct,staged,auto --repeat 5 \
  --json "$OUT/bench-2gpu.json" 2>&1 | tail -45

step "kvxferd bench, one GPU"
CUDA_VISIBLE_DEVICES=0 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented --strategy direct,staged,auto --repeat 5 \
  --json "$OUT/bench-1gpu.json" 2>&1 | tail -35

step "engine-attached vs daemon-owned pulls, two GPUs"
python3 -m bench.attached_pull --device cuda --json "$OUT/attached.json" 2>&1 | tail -6
step "done"
