#!/usr/bin/env bash
# Check the wire contract: (1) the checked-in generated code in kvxferd/v1/ equals a fresh
# regeneration from proto/, (2) buf lint (buf.yaml: STANDARD + COMMENTS) passes, (3) the protos
# are buf-formatted. Exits non-zero, saying what to run, on any failure.
#
# Works on a fresh machine with python3 + pip and node + npm:
#   * the pinned generators (python scripts/gen_proto.py --pins) are used from $PYTHON (default
#     python3) if it has them, else installed into a cached virtualenv;
#   * buf is $BUF if set, else installed by npm from package.json/package-lock.json into
#     a cache folder (nothing is written into the repository).
#
# Environment:
#   PYTHON                 interpreter to try first (default: python3)
#   BUF                    a buf binary to use instead of the npm-pinned one
#   KVXFERD_TOOLS_CACHE    where tools are installed (default: ${XDG_CACHE_HOME:-~/.cache}/kvxferd-tools)
#   KVXFERD_NO_INSTALL=1   never install anything: fail if a tool is missing
#   BUF_BREAKING_AGAINST   also run `buf breaking` against this input, e.g.
#                          '.git#branch=main' (from the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CACHE="${KVXFERD_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvxferd-tools}"
PY="${PYTHON:-python3}"

die() {
  printf '\ncheck_proto: FAILED: %s\n' "$*" >&2
  exit 1
}
step() { printf '==> %s\n' "$*"; }

hash_of() { # a short stable key for cache folders
  printf '%s' "$*" | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])'
}

command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found (set PYTHON=...)"

# --- 1. Python generators -----------------------------------------------------------------
PINS="$("$PY" scripts/gen_proto.py --pins)" || die "scripts/gen_proto.py --pins failed"
if ! "$PY" scripts/gen_proto.py --check-tools 2>/dev/null; then
  [[ "${KVXFERD_NO_INSTALL:-0}" == 1 ]] && {
    "$PY" scripts/gen_proto.py --check-tools || true
    die "pinned generators missing and KVXFERD_NO_INSTALL=1: python -m pip install $PINS"
  }
  VENV="$CACHE/py-$(hash_of "$PINS $("$PY" -c 'import sys; print(sys.version)')")"
  if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" scripts/gen_proto.py --check-tools 2>/dev/null; then
    step "installing $PINS into $VENV"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV" || die "could not create a virtualenv at $VENV (python3-venv missing?)"
    # shellcheck disable=SC2086  # PINS is a space-separated requirement list
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $PINS \
      || die "pip install $PINS failed"
  fi
  PY="$VENV/bin/python"
fi

# --- 2. Regenerate into a temp dir and diff ------------------------------------------------
TMP="$(mktemp -d "${TMPDIR:-/tmp}/kvxferd-check-proto.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

step "regenerating kvxferd/v1 from proto/ with $("$PY" scripts/gen_proto.py --pins)"
"$PY" scripts/gen_proto.py --out "$TMP/fresh" >/dev/null || die "code generation failed (see above)"

mkdir -p "$TMP/checked-in/kvxferd/v1"
shopt -s nullglob
for f in kvxferd/v1/*_pb2.py kvxferd/v1/*_pb2.pyi kvxferd/v1/*_pb2_grpc.py kvxferd/v1/*_pb2_grpc.pyi; do
  cp "$f" "$TMP/checked-in/$f"
done
shopt -u nullglob

if ! diff -ru "$TMP/checked-in/kvxferd/v1" "$TMP/fresh/kvxferd/v1" >"$TMP/drift.diff"; then
  head -n 200 "$TMP/drift.diff" >&2
  lines=$(wc -l <"$TMP/drift.diff")
  ((lines > 200)) && echo "... ($lines diff lines in all)" >&2
  die "generated code in kvxferd/v1/ is out of date with proto/ (diff above: checked-in vs fresh).
Run: python scripts/gen_proto.py   (with $PINS installed), then commit kvxferd/v1/."
fi
step "generated code is up to date"

# --- 3. buf lint + format ------------------------------------------------------------------
if [[ -z "${BUF:-}" ]]; then
  command -v npm >/dev/null 2>&1 || die "npm not found: install node + npm, or set BUF=/path/to/buf"
  NODE_DIR="$CACHE/npm-$(hash_of "$(cat package.json package-lock.json)")"
  if [[ ! -x "$NODE_DIR/node_modules/.bin/buf" ]] || ! "$NODE_DIR/node_modules/.bin/buf" --version >/dev/null 2>&1; then
    [[ "${KVXFERD_NO_INSTALL:-0}" == 1 ]] && die "buf missing and KVXFERD_NO_INSTALL=1: set BUF=/path/to/buf"
    step "installing buf (package-lock.json) into $NODE_DIR"
    rm -rf "$NODE_DIR"
    mkdir -p "$NODE_DIR"
    cp package.json package-lock.json "$NODE_DIR/"
    # `npm install`, not `npm ci`: the lock holds only the platform packages (linux-x64,
    # linux-aarch64) the registry it was made from serves, and `npm ci` rejects such a lock as
    # out of sync. The versions stay exact: package.json pins @bufbuild/buf, which pins its
    # platform packages to the same version; the lock adds integrity hashes.
    (cd "$NODE_DIR" && npm install --no-audit --no-fund --loglevel=error) \
      || die "npm install of @bufbuild/buf failed (registry unreachable?); set BUF=/path/to/buf to use another"
  fi
  BUF="$NODE_DIR/node_modules/.bin/buf"
fi
"$BUF" --version >/dev/null 2>&1 || die "buf at '$BUF' does not run on this platform; set BUF=/path/to/buf"

step "buf lint ($("$BUF" --version))"
"$BUF" lint || die "buf lint found problems in proto/ (listed above; rules in buf.yaml)"

step "buf format"
"$BUF" format --diff --exit-code >&2 || die "proto/ is not buf-formatted. Run: buf format -w"

if [[ -n "${BUF_BREAKING_AGAINST:-}" ]]; then
  step "buf breaking against $BUF_BREAKING_AGAINST"
  "$BUF" breaking --against "$BUF_BREAKING_AGAINST" \
    || die "wire-incompatible change against $BUF_BREAKING_AGAINST: bump the package (kvxferd.v2) or keep it compatible"
fi

step "proto contract OK"
