#!/usr/bin/env bash
# Session 16, fifth call: the launch's cold cost taken apart (bench/studies/launch_cost.py: the
# dispatcher alone cooled, the op after the dispatcher's path was warmed) and the op call alone
# stamped inside the decode daemon (bench/timeline_hook: op> / op<).
. bench/device/env.sh
machine
build_kernels
step "launch cost, part by part"
timeout 200 python3 -m bench.studies.launch_cost
step "control path, decode daemon stamped"
rm -rf /tmp/tl && mkdir -p /tmp/tl
PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH KVX_TIMELINE_DIR=/tmp/tl timeout 150 \
  python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
  --pulls "${PULLS:-2000}" --json "$OUT/cp-timeline.json"
python3 -m bench.timeline_report /tmp/tl > "$OUT/timeline.txt"; grep -E "launch|run_copy|op[<>]|wait_event|pulls" "$OUT/timeline.txt"
step "done"
