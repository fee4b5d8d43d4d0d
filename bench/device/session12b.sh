#!/usr/bin/env bash
# Session 12, second call: where a 16-block KERNEL pull's host time goes on the GPU machine's
# host (cProfile of the decode daemon through bench/profile_hook, summarised per pull by
# bench/profile_report), then the A/B of bench/device/session12.sh without its pinning runs.
. bench/device/env.sh
machine
build_kernels
ROOT=$PWD
step "cProfile of the decode daemon: ${PROF_PULLS:-2000} KERNEL pulls"
mkdir -p "$OUT/prof"
KVX_PROFILE_DIR=$OUT/prof PYTHONPATH=$ROOT/bench/profile_hook:$PYTHONPATH timeout 150 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${PROF_PULLS:-2000}" --warmup 200
python3 -m bench.profile_report "$OUT"/prof/decode-*.prof --pulls $(( ${PROF_PULLS:-2000} + 200 )) --top "${TOP:-70}"
tar -C "$OUT" -czf "$OUT/prof.tgz" prof && rm -rf "$OUT/prof"
SPIN=0 GPU_TESTS=0 bash bench/device/session12.sh 2>&1 | sed -n '/== control path/,$p'
