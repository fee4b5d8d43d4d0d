#!/usr/bin/env bash
# Session 13 on the lent GPU machine (Python 3.12 there, so kvxferd/tasks.py starts tasks
# eagerly): (1) the CPU tests of what changed, on 3.12: the Unix-socket channels as asyncio
# protocols (kvxferd/wire/local.py, kvxferd/service/local_peer.py), eager task starts
# (kvxferd/tasks.py) and the pulls that use them; (2) an A/B of the per-pull cost, _base (git
# archive of the previous main) against the working tree, alternating, bench.control_path on
# cuda:0, 16-block pulls (ROUNDS, default "1 2 3") and 512-block (1 GiB) pulls (BIG_ROUNDS,
# default "1 2"). GPU_TESTS=1 first runs every gpu test.
. bench/device/env.sh
machine
build_kernels
[ "${GPU_TESTS:-0}" = 1 ] && TESTS_S=260 gpu_tests "every gpu test" tests
step "CPU tests of the changed parts, Python $(python3 -c 'import sys; print(sys.version.split()[0])')"
timeout "${CPU_TESTS_S:-240}" python3 -m pytest -q -rfE -p no:cacheprovider -m "slow or not slow" \
  tests/test_tasks.py tests/wire tests/service/test_local_server.py \
  tests/service/test_local_peer.py tests/service/test_scheduler_socket.py \
  tests/service/test_start_pull_wait.py tests/service/test_safety.py > "$OUT/tests-cpu.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-cpu.log" | tail -12
ROUNDS=${ROUNDS:-1 2 3} control_ab ""
ROUNDS=${BIG_ROUNDS:-1 2} PULLS=${BIG_PULLS:-300} control_ab big --blocks 512
step "done"
