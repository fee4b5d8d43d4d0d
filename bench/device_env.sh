# Sourced by the bench/device_*.sh scripts on the lent GPU machine: $OUT, unbuffered Python,
# and the wheels the machine lacks (carried in .whl/, see bench/device_session.sh) installed
# into /tmp/site ahead of the repository on PYTHONPATH.
set -u
OUT=${OUT:-/tmp/kvxferd-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD
