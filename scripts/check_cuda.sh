#!/usr/bin/env bash
# Compile the CUDA kernels (the sources kvxferd.kernels.loader builds) on a machine without a GPU or a CUDA
# toolkit: a compile error is found here in ~3 minutes instead of on a lent GPU machine. Nothing
# is linked or run. nvcc comes from NVIDIA's pip wheels (nvidia-cuda-nvcc with the nvvm and crt
# of the same release, the runtime and CCCL headers), installed into a cached virtualenv; torch's
# headers come from the torch that runs the tests (a CPU build ships c10/cuda's headers but not
# the generated cuda_cmake_macros.h, which this script stands in for).
#
# Usage: scripts/check_cuda.sh            (from the repository root; exits non-zero on an error)
# Environment:
#   PYTHON               the interpreter whose torch supplies the headers (default: .venv/bin/python)
#   KVXFERD_TOOLS_CACHE  where nvcc is installed (default: ${XDG_CACHE_HOME:-~/.cache}/kvxferd-tools)
#   CUDA_WHEELS          the CUDA release of the wheels (default: 13.0, torch 2.11's CUDA on the
#                        GPU machines)
#   ARCH                 the architecture compiled for (default: 90, Hopper)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${KVXFERD_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvxferd-tools}
REL=${CUDA_WHEELS:-13.0}
ARCH=${ARCH:-90}
env=$CACHE/nvcc-$REL
if [ ! -x "$env/bin/python" ]; then
  echo "installing nvcc $REL into $env"
  python3 -m venv "$env"
  "$env/bin/pip" install -q "nvidia-cuda-nvcc==$REL.*" "nvidia-nvvm==$REL.*" \
    "nvidia-cuda-crt==$REL.*" "nvidia-cuda-runtime==$REL.*" "nvidia-cuda-cccl==$REL.*"
fi
nv=$(find "$env" -path '*/nvidia/cu*/bin/nvcc' -type f | head -1)
[ -n "$nv" ] || { echo "no nvcc under $env: remove it and run again" >&2; exit 1; }
nv_root=$(dirname "$(dirname "$nv")")
# torch's own header paths, and the sources the loader builds (kvxferd.kernels.loader.SOURCES).
mapfile -t torch_incs < <("$PYTHON" -c "import torch.utils.cpp_extension as c; print(*c.include_paths(), sep='\n')")
mapfile -t sources < <("$PYTHON" -c "from kvxferd.kernels.loader import SOURCES; print(*SOURCES, sep='\n')")
py_inc=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/inc/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$work/inc/c10/cuda/impl/cuda_cmake_macros.h"
incs=(-I"$work/inc" -I"$nv_root/include" "${torch_incs[@]/#/-I}" -I"$py_inc"
  -DTORCH_EXTENSION_NAME=kvxferd_staging)
export PATH=$nv_root/bin:$PATH
rc=0
for name in "${sources[@]}"; do
  src=cuda/$name
  if [[ $name == *.cu ]]; then
    echo "nvcc $src (sm_$ARCH)"
    "$nv" -std=c++20 -O3 -c "$src" -o "$work/$name.o" "${incs[@]}" \
      -gencode="arch=compute_$ARCH,code=sm_$ARCH" --diag-suppress=20013,20015,3306 || rc=1
  else
    echo "c++ $src"
    c++ -std=c++20 -O1 -Wall -c "$src" -o "$work/$name.o" "${incs[@]}" || rc=1
  fi
done
[ $rc -eq 0 ] && echo "the CUDA sources compile" || echo "the CUDA sources do not compile" >&2
exit $rc
