#!/usr/bin/env bash
# One call on the lent GPU machine that checks a change end to end on a GPU: build the CUDA
# kernels, run every `gpu`-marked test of the suite, push against a DIRECT pull, and the
# one-table bench (raw copy, naive, floor, KERNEL, DIRECT, STAGED, auto; both daemons on
# cuda:0). Run from the root of the tree under test, with the wheels the machine lacks in $WHL
# (default .whl; bench/device/session.sh's header says how to fetch them). Each step is
# time-boxed so the call ends inside 10 minutes; logs and JSON go under $OUT, the short
# results last.
set -u
OUT=${OUT:-/tmp/kvxferd-device}
WHL=${WHL:-.whl}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHL"/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, grpc, google.protobuf as pb; print('torch', torch.__version__, \
'grpc', grpc.__version__, 'protobuf', pb.__version__)"
step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels"
timeout 240 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

step "every gpu-marked test"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests -rs > "$OUT/tests-gpu.log" 2>&1
echo "pytest exit $?"
grep -E "passed|failed|error" "$OUT/tests-gpu.log" | tail -3

step "push against a DIRECT pull (tests/push/test_push_gpu.py, printed)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/push/test_push_gpu.py \
  > "$OUT/push-gpu.log" 2>&1
grep -iE "push|direct|passed|failed" "$OUT/push-gpu.log" | tail -8

step "kvxferd bench: raw, naive, floor, KERNEL, DIRECT, STAGED, auto"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct,staged,auto --repeat 3 \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?"
sed -n '/^tokens /,$p' "$OUT/bench.log" | tail -30
step "done"
