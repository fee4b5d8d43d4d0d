#!/usr/bin/env bash
# Session 14, last call: every gpu test at the session's code; how the machine's NumPy reads a
# protobuf repeated field (kvxferd/wire/codec.py); _base (the previous main) and this tree
# alternating through the daemons (16-block KERNEL pulls, ROUNDS default "1 2"); then this
# tree's bench table (KERNEL; 16-block latency, 32 MiB and 1 GiB rows).
. bench/device/env.sh
machine
build_kernels
[ "${GPU_TESTS:-1}" = 1 ] && TESTS_S=250 gpu_tests "every gpu test" tests
step "protobuf repeated field -> int64 array (us per call)"
python3 - <<'PY'
import timeit, numpy as np
from kvxferd.wire.codec import group_ids_from_proto, group_ids_to_proto
print("numpy", np.__version__)
for n in (16, 512):
    msg = group_ids_to_proto([np.arange(n)])
    g = msg.groups[0]
    for name, f in (("asarray", lambda: np.asarray(g.ids, dtype=np.int64)),
                    ("array(slice)", lambda: np.array(g.ids[:], dtype=np.int64)),
                    ("codec", lambda: group_ids_from_proto(msg)),):
        t = min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6
        print(f"  {n:4d} {name:13s} {t:7.2f}")
PY
ROUNDS=${ROUNDS:-1 2} control_ab ""
step "kvxferd bench, KERNEL, this tree"
timeout 150 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel --repeat 3 --latency-pulls 200 \
  --json "$OUT/bench-new.json" > "$OUT/bench-new.log" 2>&1
tail -25 "$OUT/bench-new.log"
step "done"
