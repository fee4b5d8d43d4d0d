#!/usr/bin/env bash
# A/B on one warm GPU machine: an older commit against the working tree, alternating, so the
# two are compared on the same card and host (machines of one kind differ by 20-40% between
# calls). Prepare the older tree here first, then carry it and the wheels:
#   rm -rf _base && mkdir _base && git archive <commit> | tar -x -C _base
#   run: bash bench/device/ab.sh   (carry: [".whl", "_base"]; .whl as bench/device/session.sh
#   says, without py-spy.xz: the 64 MiB carry limit)
# Each side runs `kvxferd bench` (16-block latency for the first strategy, and 32 MiB and 1 GiB
# random rows for each) in each of $ROUNDS (default "1 2"); JSON and logs go under $OUT.
set -u
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
ROOT=$PWD
for round in ${ROUNDS:-1 2}; do
  for side in base new; do
    dir=$ROOT; [ "$side" = base ] && dir=$ROOT/_base
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 150 python3 -m kvxferd bench --device cuda \
      --sizes 256,8192 --patterns "${PATTERNS:-fragmented}" --strategy "${STRATEGIES:-kernel,direct}" \
      --repeat 3 --latency-pulls 200 --json "$OUT/$side-$round.json" > "$OUT/$side-$round.log" 2>&1)
    echo "== $side round $round"
    grep -E "kvxferd (kernel|direct|staged|auto)|small-request|where the" "$OUT/$side-$round.log"
  done
done
