# Sourced by the bench/device/*.sh scripts on the lent GPU machine: $OUT, unbuffered Python,
# and the wheels the machine lacks (carried in .whl/, see bench/device/session.sh) installed
# into /tmp/site ahead of the repository on PYTHONPATH. Since session 9 the nixl-cu13 wheel is
# carried without its expert-parallel builds for other torch versions (zip -d the wheel
# 'nixl_ep_cu13/nixl_ep_cpp_torch21*': the machine's torch 2.11 cannot load them, and with them
# the tree, .whl and py-spy's wheel exceed the 64 MiB carry).
set -u
OUT=${OUT:-/tmp/kvxferd-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD

# Shared steps of the bench/device/session*.sh scripts.
step() { echo; echo "== $1 ($(date -u +%T))"; }
machine() { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; }
build_kernels() {
  step "build the CUDA kernels"
  timeout 200 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"
}
# gpu_tests LABEL PATH...: the gpu-marked tests under PATH..., within $TESTS_S seconds.
gpu_tests() {
  local label=$1; shift
  step "gpu tests: $label"
  timeout "${TESTS_S:-230}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu "$@" \
    > "$OUT/tests-gpu.log" 2>&1
  echo "pytest rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-gpu.log" | tail -12
}
# control_ab TAG [ARGS...]: bench.control_path (16-block KERNEL pulls of the llama-shaped pool on
# cuda:0; ARGS are added, a later --pulls wins), the _base tree then this one, in each round of
# $ROUNDS (default "1 2"); each side's daemons import its own tree. JSON: $OUT/cp-TAG<side>-<round>.json.
control_ab() {
  local tag=$1 root=$PWD dir round side; shift
  for round in ${ROUNDS:-1 2}; do
    for side in base new; do
      dir=$root; [ "$side" = base ] && dir=$root/_base
      step "control path${tag:+ ($tag)}: $side, round $round"
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 120 python3 "$root/bench/control_path.py" \
        --device cuda --pool dense:num_blocks=600 --pulls "${PULLS:-2000}" "$@" \
        --json "$OUT/cp-$tag$side-$round.json")
    done
  done
}
# control_lazy TAG [ARGS...]: bench.control_path on this tree with eager task starts turned off
# (bench/lazy_hook), for the rounds of $ROUNDS; JSON $OUT/cp-TAGlazy-<round>.json.
control_lazy() {
  local tag=$1 round; shift
  for round in ${ROUNDS:-1 2}; do
    step "control path${tag:+ ($tag)}: new without eager starts, round $round"
    PYTHONPATH=$PWD/bench/lazy_hook:$PYTHONPATH timeout 120 python3 bench/control_path.py \
      --device cuda --pool dense:num_blocks=600 --pulls "${PULLS:-2000}" "$@" \
      --json "$OUT/cp-${tag}lazy-$round.json"
  done
}
# spy_decode: bench.control_path on this tree (16-block KERNEL pulls on cuda:0, $SPY_PULLS of
# them, default 10,000) with its decode daemon sampled by py-spy (--gil, 2,000 Hz) for $SPY_S
# seconds (default 8) once $SETTLE_S seconds (default 20) have passed. Collapsed stacks:
# $OUT/spy-decode.txt (summarise with python -m bench.spy_report); the run: $OUT/cp-prof.*.
spy_decode() {
  local spy=/tmp/site/bin/py-spy cp dec
  step "control path with the decode daemon sampled"
  timeout 200 python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 \
    --pulls "${SPY_PULLS:-10000}" --json "$OUT/cp-prof.json" > "$OUT/cp-prof.log" 2>&1 &
  cp=$!
  for _ in $(seq 240); do pgrep -f "decode.sched.sock" > /dev/null && break; sleep 0.5; done
  sleep "${SETTLE_S:-20}"
  dec=$(pgrep -f "decode.sched.sock" | head -1)
  "$spy" record --nonblocking --gil -r 2000 -d "${SPY_S:-8}" -f raw -p "$dec" \
    -o "$OUT/spy-decode.txt" > "$OUT/spy.log" 2>&1
  echo "py-spy rc=$? ($(wc -l < "$OUT/spy-decode.txt") stacks)"
  wait $cp
  cat "$OUT/cp-prof.log"
}
# build_base: the kernels of the _base tree (a git archive of kvxferd, cuda and bench at the
# commit an A/B compares against), built with that tree's own loader and sources.
build_base() {
  (cd "$PWD/_base" && PYTHONPATH=/tmp/site:$PWD build_kernels)
}
# ab_own TAG LINES [ARGS...]: bench.control_path, each side with its own tree's script, code and
# daemons (_base, then this tree) in each round of $ROUNDS (default "1 2"); ARGS are the
# control path's (--device cuda is given); the first LINES lines of each run are printed.
# JSON: $OUT/TAG-<side>-<round>.json.
ab_own() {
  local tag=$1 lines=$2 root=$PWD dir round side; shift 2
  for round in ${ROUNDS:-1 2}; do
    for side in base new; do
      dir=$root; [ "$side" = base ] && dir=$root/_base
      step "control path ($tag): $side, round $round"
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 120 python3 bench/control_path.py \
        --device cuda "$@" --json "$OUT/$tag-$side-$round.json" 2>&1 | head -"$lines")
    done
  done
}
# timelines16 STEPS: 1,500 16-block KERNEL pulls of the control path on this tree with both
# daemons' timelines (bench/timeline_hook); the report goes to $OUT/timeline-16.txt and its
# rows matching the extended regex STEPS are printed.
timelines16() {
  step "timelines, 16 blocks"
  rm -rf /tmp/tl && mkdir -p /tmp/tl
  KVX_TIMELINE_DIR=/tmp/tl PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH timeout 100 \
    python3 bench/control_path.py --device cuda --pool dense:num_blocks=600 --pulls 1500 \
    --json "$OUT/cp16-timeline.json" 2>&1 | head -1
  python3 -m bench.timeline_report /tmp/tl --skip 300 > "$OUT/timeline-16.txt" 2>&1
  grep -E "$1" "$OUT/timeline-16.txt" | head -30
}
# perrep JSON: the kvxferd row's pulls of a `kvxferd bench --json` file, rep by rep, and its x naive.
perrep() { python3 -c "
import json,sys
r=json.load(open(sys.argv[1]))['rows'][0]
print('  ms by rep:', ' '.join(f'{x:.2f}' for x in r['kvxferd']['ms']), '| x naive', round(r['kvxferd_vs_naive'],1))" "$1"; }
# bench_1g: the bench's 1 GiB random rows once (naive and KERNEL in one run, for x naive), the
# kvxferd row rep by rep. Output: $OUT/bench-1g.{json,txt,err}.
bench_1g() {
  step "bench, 1 GiB random"
  timeout 240 python3 -m kvxferd bench --device cuda --sizes 8192 --patterns fragmented \
    --strategy kernel --repeat 5 --json "$OUT/bench-1g.json" > "$OUT/bench-1g.txt" 2>"$OUT/bench-1g.err"
  echo "bench rc=$?"; grep -E "8192" "$OUT/bench-1g.txt"; perrep "$OUT/bench-1g.json"
}
# bench_ab TAG ARGS...: `kvxferd bench --device cuda ARGS`, each side its own tree's (_base, then
# this tree) in each round of $ROUNDS (default "1 2"); the naive and kvxferd rows and the result
# printed, then the kvxferd row rep by rep. JSON: $OUT/TAG-<side>-<round>.json.
bench_ab() {
  local tag=$1 root=$PWD dir round side; shift
  for round in ${ROUNDS:-1 2}; do
    for side in base new; do
      dir=$root; [ "$side" = base ] && dir=$root/_base
      step "bench ($tag): $side, round $round"
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python3 -m kvxferd bench --device cuda \
        "$@" --json "$OUT/$tag-$side-$round.json" 2>&1 | grep -E "kvxferd kernel: |naive \(1|^result")
      perrep "$OUT/$tag-$side-$round.json"
    done
  done
}
# control_memo LABEL HOOKDIR [ARGS...]: bench.control_path on cuda:0 cycling through 8 block-ID
# lists (--distinct 8), with HOOKDIR (e.g. bench/memo_hook; "" for none) ahead on PYTHONPATH;
# ARGS are the control path's. JSON: $OUT/cp-LABEL.json.
control_memo() {
  local label=$1 hook=$2; shift 2
  step "control path: $label"
  PYTHONPATH=${hook:+$PWD/$hook:}$PYTHONPATH timeout 120 python3 bench/control_path.py \
    --device cuda --distinct 8 "$@" --json "$OUT/cp-$label.json" 2>&1 | head -2
}
