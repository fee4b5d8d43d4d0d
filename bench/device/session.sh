#!/usr/bin/env bash
# One call on the lent GPU machine (issue 13: KERNEL, transport truth, STAGED, one table).
# Run from the repository root with the wheels the machine lacks carried in .whl/
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1 protobuf==7.36.2 grpcio-health-checking==1.66.2
# grpcio-reflection==1.66.2 pytest-timeout==2.4.0`; without the nixl meta wheel, which does not
# fit beside nixl-cu13 in one call). The machine's grpcio 1.84 is above the stubs' floor
# (1.66.2), so nothing is patched. Each step is time-boxed;
# full outputs are written under $OUT (at most 8 files come back) and the short table is last.
. bench/device/env.sh
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -4
python3 -c "import torch, grpc, google.protobuf as pb; print('torch', torch.__version__, \
'grpc', grpc.__version__, 'protobuf', pb.__version__)"

step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels (staging + copy_ranges)"
timeout 240 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

step "kvxferd bench: raw, naive, floor, KERNEL, DIRECT, STAGED, auto (both daemons on cuda:0)"
timeout "${BENCH_S:-260}" python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct,staged,auto --repeat 5 \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
sed -n '/^tokens /,$p' "$OUT/bench.log"

step "GPU tests: the kernel against the twin, imported memory, bounds, restarted owner"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ipc/test_gpu.py \
  -k "not daemons" > "$OUT/tests-unit.log" 2>&1
tail -6 "$OUT/tests-unit.log"

step "KERNEL copy alone: imported vs owned, grid caps (bench/ipc_kernel.py)"
timeout 120 python3 -m bench.ipc_kernel --caps 16,32,64,132,0 --json "$OUT/ipc.json" 2>&1 \
  | sed -n '/^row /,$p'

if [ -n "${TCP_CHECK:-}" ]; then
  step "default transport refused: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n (operator's choice kept)"
  UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n timeout 100 python3 -m kvxferd bench --device cuda --sizes 256 \
    --patterns fragmented --strategy kernel,direct --repeat 1 --latency-pulls 1 \
    --json "$OUT/bench-tcp.json" > "$OUT/bench-tcp.log" 2>&1
  grep -v "^kvxferd: \|^naive\|^raw\|^ *kvxferd \+[0-9]\|^  naive" "$OUT/bench-tcp.log" | tail -12
fi

step "engine-attached (OWNED) pool vs daemon-owned, pulled by KERNEL (bench/attached_pull.py)"
timeout 120 python3 -m bench.attached_pull --device cuda --json "$OUT/attached.json" 2>&1 | tail -6

step "GPU tests through daemons: KERNEL dense/hybrid/MLA by Checksum, STAGED in VRAM, kernels"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/ipc/test_gpu.py::test_kernel_pull_between_daemons_is_byte_exact \
  tests/service/test_service_staged_gpu.py tests/kernels/test_cuda.py \
  > "$OUT/tests-daemons.log" 2>&1
tail -8 "$OUT/tests-daemons.log"
step "done"
