#!/usr/bin/env bash
# One call on the lent GPU machine (issues 13 and 14): where a small pull's time goes, measured
# with a sampling profiler on the running daemons, then the bench table. Carry .whl/ as
# bench/device/session.sh says, plus `.whl/py-spy.xz` (the py-spy binary, xz-compressed: the
# machine has no internet; py-spy is not a kvxferd dependency). Each step is time-boxed;
# profiles (py-spy "raw" collapsed stacks) and logs go under $OUT; the short table is last.
. bench/device/env.sh
SPY=/tmp/py-spy
python3 -c "import lzma,sys; open('$SPY','wb').write(lzma.open('.whl/py-spy.xz').read())" \
  && chmod +x $SPY
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() { echo; echo "== $1 ($(date -u +%T))"; }

step "build the CUDA kernels"
timeout 240 python3 -c "from kvxferd.kernels import active_backend as a; print(a().describe())"

profile() {  # $1 = strategy: profile both daemons and the client during 16-block pulls
  local log="$OUT/prof-$1.log"
  timeout 150 python3 -m kvxferd bench --device cuda --sizes 256 --patterns fragmented \
    --strategy "$1" --repeat 1 --latency-pulls "${PULLS:-3000}" --no-verify \
    --json "$OUT/prof-$1.json" > "$log" 2>&1 &
  local bench=$!
  for _ in $(seq 200); do grep -q "latency  " "$log" && break; sleep 0.25; done
  sleep 1
  local dec pre cli
  dec=$(pgrep -f "decode.ready.json" | head -1)
  pre=$(pgrep -f "prefill.ready.json" | head -1)
  cli=$(pgrep -P "$bench" | head -1)
  $SPY record --nonblocking --gil -r 2000 -d 4 -f raw -p "$dec" -o "$OUT/spy-$1-decode.txt" \
    > /dev/null 2>&1 &
  $SPY record --nonblocking --gil -r 2000 -d 4 -f raw -p "$pre" -o "$OUT/spy-$1-prefill.txt" \
    > /dev/null 2>&1 &
  $SPY record --nonblocking --gil -r 2000 -d 4 -f raw -p "$cli" -o "$OUT/spy-$1-client.txt" \
    > /dev/null 2>&1
  wait
  grep -E "small-request|where the daemon" "$log"
}
step "profile: KERNEL 16-block pulls"
profile kernel
step "profile: DIRECT 16-block pulls"
profile direct

step "every gpu-marked test"
timeout "${TESTS_S:-260}" python3 -m pytest -q -p no:cacheprovider -m gpu tests \
  > "$OUT/tests-gpu.log" 2>&1
tail -3 "$OUT/tests-gpu.log"

step "bench table: 16-block latency and 1 GiB, KERNEL, DIRECT, auto"
timeout 200 python3 -m kvxferd bench --device cuda --sizes 256,8192 \
  --patterns fragmented,contiguous --strategy kernel,direct --repeat 3 --latency-pulls 100 \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
sed -n '/^tokens /,$p' "$OUT/bench.log" | tail -25
# At most 8 files come back from the machine: the profiles travel as one archive.
(cd "$OUT" && tar czf profiles.tgz spy-*.txt prof-*.log prof-*.json && rm -f spy-*.txt prof-*)
step "done"
