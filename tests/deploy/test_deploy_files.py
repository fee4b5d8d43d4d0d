"""Deployment files (deploy/, Dockerfile) agree with the code they deploy.

Parse-level checks: every metric and label the dashboard and the alert rules query exists in
:mod:`kvxferd.metrics` (tests/ops checks the same against live daemons); label values they
match exist in the code's enums; the example configs
load through :func:`kvxferd.config.load_config`; the systemd unit, the Kubernetes manifests and
the Dockerfile run ``kvxferd serve`` with the ports, probes and timeouts the config implies.
With ``promtool`` on PATH (Debian: ``apt-get install prometheus``) the PromQL is also parsed
and every alert is evaluated against synthetic series, firing and not firing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvxferd import metrics as m
from kvxferd.config import documented_keys, load_config, split_hostport
from kvxferd.daemon.peers import LinkState
from kvxferd.daemon.pulls import PullState
from kvxferd.metrics import LiveState, Metrics
from kvxferd.service.app import PEER_SERVICE, TCP_SERVICES
from kvxferd.staging.stats import Occupancy
from kvxferd.transfer.leases import ReleaseReason

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvxferd-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "kvxferd-alerts.yaml"
UNIT = DEPLOY / "systemd" / "kvxferd.service"
UNIT_CONFIG = DEPLOY / "systemd" / "kvxferd.toml"
UNIT_ENV = DEPLOY / "systemd" / "kvxferd.env.example"
K8S = DEPLOY / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

TARGET_LABELS = frozenset({"job", "instance"})  # added by Prometheus at scrape time
NAME_RE = re.compile(r"\b(?:kvxferd|process)_[a-z0-9_]+\b")
SELECTOR_RE = re.compile(r"\b((?:kvxferd|process)_[a-z0-9_]+|up)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
RATE_RE = re.compile(r"\b(?:rate|irate|increase)\(\s*((?:kvxferd|process)_[a-z0-9_]+)")


# --- what kvxferd.metrics exports ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Series:
    family: str
    kind: str  # counter, gauge, histogram
    labels: frozenset[str]


LIVE = LiveState(
    pulls={"PENDING": 1},
    inflight_bytes={"10.0.0.1:50051": 1},
    links={"READY": 1},
    leases=1,
    staging=Occupancy(slots=2, free=1, reader_cap=1, granted={"r": 1}),
)


def _exported() -> dict[str, Series]:
    """Sample name -> family: counters as ``_total``, histograms as ``_bucket/_sum/_count``.

    Read from a registry as the daemon builds it (event series, the live collector, process
    metrics), with one sample of each labelled series so that its label names show."""
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    metrics.add_live(lambda: LIVE)
    metrics.transfer_bytes.labels("10.0.0.1:50051").inc()
    metrics.observe_pull_end("10.0.0.1:50051", "DONE", 0.1)
    metrics.rpc_errors.labels("StartPull", "INTERNAL").inc()
    metrics.rpcs.labels("kvxferd.v1.Scheduler", "StartPull", "OK").inc()
    metrics.rpc_seconds.labels("kvxferd.v1.Scheduler", "StartPull").observe(0.1)
    metrics.peer_rpcs.labels("Handshake", "OK").inc()
    metrics.peer_rpc_seconds.labels("Handshake").observe(0.1)
    out: dict[str, Series] = {}
    for family in registry.collect():
        base = family.name
        for sample in family.samples:
            labels = frozenset(sample.labels) - {"quantile"}
            prev = out.get(sample.name)
            out[sample.name] = Series(
                base, family.type, labels | (prev.labels if prev else frozenset())
            )
    return out


EXPORTED = _exported()

# Label values the code produces, for the matchers that select one of them.
KNOWN_VALUES: dict[tuple[str, str], list[str]] = {
    ("kvxferd_transfers", "state"): list(m.TERMINAL_STATES),
    ("kvxferd_transfers", "strategy"): list(m.STRATEGIES),
    ("kvxferd_transfer_duration_seconds", "state"): list(m.TERMINAL_STATES),
    ("kvxferd_peer_pulls", "state"): list(m.TERMINAL_STATES),
    ("kvxferd_pulls", "state"): list(m.ACTIVE_STATES),
    ("kvxferd_lease_releases", "reason"): list(m.RELEASE_REASONS),
    ("kvxferd_peers", "state"): list(m.LINK_STATES),
    ("kvxferd_notifications", "result"): list(m.NOTIFICATION_RESULTS),
    ("kvxferd_handshakes", "result"): sorted({r for v in m.HANDSHAKE_RESULTS.values() for r in v}),
    ("kvxferd_staging_slots", "use"): ["free", "granted", "local"],
    ("kvxferd_rpc_errors", "code"): [c.name for c in grpc.StatusCode],
    ("kvxferd_rpcs", "code"): [c.name for c in grpc.StatusCode],
    ("kvxferd_peer_rpcs", "code"): [c.name for c in grpc.StatusCode],
}


def test_label_value_lists_match_the_code_enums() -> None:
    from kvxferd.staging.strategy import Strategy

    assert list(m.STRATEGIES) == [s.value for s in Strategy]
    assert list(m.LINK_STATES) == [s.value for s in LinkState]
    assert list(m.RELEASE_REASONS) == [r.value for r in ReleaseReason]
    states = [s.value for s in PullState]
    assert [s for s in states if PullState(s).terminal] == list(m.TERMINAL_STATES)
    assert [s for s in states if not PullState(s).terminal] == list(m.ACTIVE_STATES)


def _check_expr(expr: str, where: str) -> None:
    """Every kvxferd series exists, with the labels it is filtered on; rates take counters;
    matched label values exist in the code's enums."""
    names = set(NAME_RE.findall(expr))
    assert names or "up{" in expr, f"{where}: no kvxferd metric in {expr!r}"
    unknown = names - EXPORTED.keys()
    assert not unknown, f"{where}: not exported by kvxferd.metrics: {sorted(unknown)}"
    for name in RATE_RE.findall(expr):
        assert EXPORTED[name].kind in ("counter", "histogram"), f"{where}: rate() of gauge {name}"
    if "histogram_quantile" in expr:
        assert "_bucket" in expr and re.search(r"by \([^)]*\ble\b", expr), (
            f"{where}: histogram_quantile needs a _bucket series aggregated by le: {expr!r}"
        )
    for name, body in SELECTOR_RE.findall(expr):
        for label, op, value in MATCHER_RE.findall(body):
            if name == "up":
                assert label in TARGET_LABELS, f"{where}: up{{{label}}}"
                continue
            series = EXPORTED[name]
            assert label in series.labels | TARGET_LABELS, (
                f"{where}: {name} has no label {label!r} (labels: {sorted(series.labels)})"
            )
            known = KNOWN_VALUES.get((series.family, label))
            if known and op in ("=", "=~", "!=", "!~") and "$" not in value:
                rx = re.compile(value if op in ("=~", "!~") else re.escape(value))
                assert any(rx.fullmatch(v) for v in known), (
                    f"{where}: {name}{{{label}{op}{value!r}}} matches none of {known}"
                )


def test_metric_table_is_what_the_checks_assume() -> None:
    # The checks below are only as good as this table: make sure it is not empty or stale.
    assert EXPORTED["kvxferd_transfers_total"].labels == {"state", "strategy"}
    assert "le" in EXPORTED["kvxferd_transfer_duration_seconds_bucket"].labels
    assert EXPORTED["kvxferd_inflight_transfers"].kind == "gauge"
    with pytest.raises(AssertionError, match="not exported"):
        _check_expr("rate(kvxferd_transfers[5m])", "self-test")  # counter without _total
    with pytest.raises(AssertionError, match="no label"):
        _check_expr('sum(kvxferd_peers{peer="x"})', "self-test")
    with pytest.raises(AssertionError, match="matches none"):
        _check_expr('rate(kvxferd_transfers_total{state="SUCCEEDED"}[5m])', "self-test")
    with pytest.raises(AssertionError, match="matches none"):
        _check_expr('kvxferd_peers{state="stale"}', "self-test")  # exact values only
    with pytest.raises(AssertionError, match="rate\\(\\) of gauge"):
        _check_expr("rate(kvxferd_inflight_transfers[5m])", "self-test")


# --- Grafana dashboard -----------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def _dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    out = [
        (f"panel {p.get('title')!r}", t["expr"])
        for p in _panels(dash)
        for t in p.get("targets", [])
    ]
    for v in dash["templating"]["list"]:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v["type"] == "query" and q:
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            out.append((f"variable {v['name']}", inner.group(1) if inner else q))
    return out


def test_dashboard_queries_use_exported_metrics_and_labels() -> None:
    exprs = _dashboard_exprs(_dashboard())
    assert len(exprs) >= 15
    for where, expr in exprs:
        _check_expr(expr, where)


def test_dashboard_covers_every_required_view() -> None:
    text = " ".join(e for _, e in _dashboard_exprs(_dashboard()))
    for name in (
        "kvxferd_transfer_bytes_total",
        "kvxferd_transfers_total",
        "kvxferd_transfer_duration_seconds_bucket",
        "kvxferd_posted_descriptors_total",
        "kvxferd_naive_descriptors_total",
        "kvxferd_pulls",
        "kvxferd_inflight_bytes",
        "kvxferd_peers",
        "kvxferd_handshakes_total",
        "kvxferd_handshake_duration_seconds_bucket",
        "kvxferd_leases_active",
        "kvxferd_lease_releases_total",
        "kvxferd_rpcs_total",
        "kvxferd_rpc_duration_seconds_bucket",
        "kvxferd_peer_rpcs_total",
        "kvxferd_peer_pulls_total",
        "kvxferd_peer_pull_duration_seconds_bucket",
        "kvxferd_pull_stage_seconds_bucket",
        "kvxferd_strategy_bytes_total",
        "kvxferd_staged_stage_seconds_sum",
        "kvxferd_staging_slots",
        "kvxferd_staging_gathers_waiting",
        "kvxferd_notifications_total",
        "kvxferd_registered_bytes",
        "kvxferd_staging_ring_bytes",
        "kvxferd_build_info",
        "process_cpu_seconds_total",
    ):
        assert re.search(rf"\b{name}\b", text), f"no panel queries {name}"
    assert "histogram_quantile(0.5," in text and "histogram_quantile(0.99," in text


def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["schemaVersion"] >= 36
    ds_vars = [v for v in dash["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert ds_vars and ds_vars[0]["type"] == "datasource" and ds_vars[0]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in _panels(dash):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"panel {p['title']!r} is wider than the grid"
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]


# --- alert rules -----------------------------------------------------------------------

REQUIRED_ALERTS = {
    "KvxferdDown",
    "KvxferdPullFailureRatioHigh",
    "KvxferdPullsExpiring",
    "KvxferdNoPeersReady",
    "KvxferdHandshakeRefusals",
    "KvxferdLeasesExpiring",
    "KvxferdRpcInternalErrors",
    "KvxferdBackPressure",
    "KvxferdPeerPullsFailing",
    "KvxferdStagingSlotsExhausted",
    "KvxferdUndecodableNotifications",
}


def _alert_rules() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_alert_metric_names_exist_without_yaml() -> None:
    # Needs no YAML parser: every kvxferd_* token outside comments must be an exported series.
    body = "\n".join(
        line for line in ALERTS.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    names = set(NAME_RE.findall(body))
    assert names, "no kvxferd metric in the alert rules"
    assert not names - EXPORTED.keys(), sorted(names - EXPORTED.keys())
    assert re.search(r"^\s*expr: up\{", body, re.M), "no daemon-down (up == 0) rule"


def test_alert_rules_are_complete_and_query_exported_metrics() -> None:
    rules = _alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert set(names) >= REQUIRED_ALERTS, sorted(REQUIRED_ALERTS - set(names))
    for r in rules:
        _check_expr(str(r["expr"]), r["alert"])
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        for key in ("summary", "description", "runbook"):
            assert str(r["annotations"].get(key, "")).strip(), f"{r['alert']}: no {key}"


# --- promtool: real PromQL parsing and evaluation ---------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")


def _promtool(*args: str | Path) -> None:
    assert PROMTOOL
    res = subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_promtool_checks_alert_rules() -> None:
    _promtool("check", "rules", ALERTS)


@needs_promtool
def test_promtool_parses_dashboard_queries(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    subst = {"$__rate_interval": "1m", "$job": "kvxferd", "$instance": ".*"}
    rules = []
    for i, (_, query) in enumerate(_dashboard_exprs(_dashboard())):
        expr = query
        for k, v in subst.items():
            expr = expr.replace(k, v)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    f = tmp_path / "dashboard.rules.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _promtool("check", "rules", f)


def _s(name: str, values: str, **labels: str) -> dict[str, str]:
    labels = {"job": "kvxferd-workers", "instance": "w:9400", **labels}
    body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


T = "kvxferd_transfers_total"
# alert -> (series that must make it fire, series that must not), sampled every minute.
SCENARIOS: dict[str, tuple[list[dict[str, str]], list[dict[str, str]]]] = {
    "KvxferdDown": ([_s("up", "0x30")], [_s("up", "1x30")]),
    "KvxferdPullFailureRatioHigh": (
        [_s(T, "0+60x30", state="DONE"), _s(T, "0+6x30", state="FAILED")],
        [_s(T, "0+60x30", state="DONE"), _s(T, "0+1x30", state="FAILED")],
    ),
    "KvxferdPullsExpiring": (
        [_s(T, "0+1x30", state="EXPIRED")],
        [_s(T, "5x30", state="EXPIRED"), _s(T, "0+60x30", state="DONE")],
    ),
    "KvxferdNoPeersReady": (
        # Known peers, none READY; and (the "or ... * 0" branch) no READY series at all.
        [_s("kvxferd_peers", "2x30", state="STALE"), _s("kvxferd_peers", "0x30", state="READY")],
        [
            _s("kvxferd_peers", "1x30", state="READY"),
            _s("kvxferd_peers", "2x30", state="REFUSED"),
        ],
    ),
    "KvxferdHandshakeRefusals": (
        [_s("kvxferd_handshakes_total", "0+1x30", side="client", result="refused")],
        [_s("kvxferd_handshakes_total", "0+1x30", side="client", result="ok")],
    ),
    "KvxferdLeasesExpiring": (
        [
            _s("kvxferd_lease_releases_total", "0+5x30", reason="DONE"),
            _s("kvxferd_lease_releases_total", "0+1x30", reason="EXPIRED"),
        ],
        [
            _s("kvxferd_lease_releases_total", "0+5x30", reason="DONE"),
            _s("kvxferd_lease_releases_total", "3x30", reason="EXPIRED"),
        ],
    ),
    "KvxferdRpcInternalErrors": (
        [_s("kvxferd_rpcs_total", "0+1x30", method="StartPull", code="INTERNAL")],
        [
            _s("kvxferd_rpcs_total", "0+1x30", method="StartPull", code="NOT_FOUND"),
            _s("kvxferd_rpcs_total", "0x30", method="StartPull", code="INTERNAL"),
        ],
    ),
    "KvxferdBackPressure": (
        [_s("kvxferd_rpcs_total", "0+60x30", method="StartPull", code="RESOURCE_EXHAUSTED")],
        [_s("kvxferd_rpcs_total", "0+1x30", method="StartPull", code="RESOURCE_EXHAUSTED")],
    ),
    "KvxferdPeerPullsFailing": (
        [
            _s("kvxferd_peer_pulls_total", "0+10x30", peer="p:1", state="FAILED"),
            _s("kvxferd_peer_pulls_total", "0+2x30", peer="p:1", state="DONE"),
            _s("kvxferd_peer_pulls_total", "0+60x30", peer="p:2", state="DONE"),
        ],
        [
            _s("kvxferd_peer_pulls_total", "0+1x30", peer="p:1", state="FAILED"),
            _s("kvxferd_peer_pulls_total", "0+60x30", peer="p:1", state="DONE"),
        ],
    ),
    "KvxferdStagingSlotsExhausted": (
        [_s("kvxferd_staging_gathers_waiting", "3x30")],
        [
            _s(
                "kvxferd_staging_gathers_waiting",
                " ".join(["0 3"] * 15),
            )
        ],
    ),
    "KvxferdUndecodableNotifications": (
        [_s("kvxferd_notifications_total", "0+1x30", result="undecodable")],
        [
            _s("kvxferd_notifications_total", "5x30", result="undecodable"),
            _s("kvxferd_notifications_total", "0+9x30", result="counted"),
        ],
    ),
}


@needs_promtool
def test_promtool_alerts_fire_on_synthetic_series(tmp_path: Path) -> None:
    """Each alert's expression, copied from the rule file, selects something on a failing
    daemon and nothing on a healthy one (the ``for:`` durations are promtool's business)."""
    yaml = pytest.importorskip("yaml")
    exprs = {r["alert"]: str(r["expr"]) for r in _alert_rules()}
    assert set(SCENARIOS) == REQUIRED_ALERTS
    tests = []
    for alert, (firing, quiet) in SCENARIOS.items():
        for series, samples in ((firing, [{"labels": "{}", "value": 1}]), (quiet, [])):
            tests.append(
                {
                    "interval": "1m",
                    "input_series": series,
                    "promql_expr_test": [
                        {
                            "expr": f"count({exprs[alert]})",
                            "eval_time": "25m",
                            "exp_samples": samples,
                        }
                    ],
                }
            )
    f = tmp_path / "alerts.test.yaml"
    f.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "tests": tests}))
    _promtool("test", "rules", f)


# --- example configs -------------------------------------------------------------------

TOKEN_ENV = {"KVXFERD_AUTH_TOKEN": "test-token"}  # what the EnvironmentFile / Secret supply


def _configmap_toml() -> str:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((K8S / "configmap.yaml").read_text())
    assert doc["kind"] == "ConfigMap"
    text: str = doc["data"]["kvxferd.toml"]
    return text


@pytest.mark.parametrize(
    "path", sorted(DEPLOY.rglob("*.toml")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_example_toml_configs_load(path: Path) -> None:
    cfg = load_config(path, env=TOKEN_ENV)
    assert not cfg.server.allow_insecure_remote, "examples must not disable the auth check"


def test_configmap_config_loads(tmp_path: Path) -> None:
    p = tmp_path / "kvxferd.toml"
    p.write_text(_configmap_toml())
    cfg = load_config(p, env={})  # the token comes from auth.token_file
    assert cfg.auth.token_file and not cfg.server.allow_insecure_remote


def test_env_example_sets_only_documented_keys() -> None:
    keys = {f"KVXFERD_{k.replace('.', '_').upper()}" for k in documented_keys()}
    names = re.findall(r"^#?(KVXFERD_\w+)=", UNIT_ENV.read_text(), re.M)
    assert "KVXFERD_AUTH_TOKEN" in names
    assert not set(names) - keys, sorted(set(names) - keys)


# --- systemd ---------------------------------------------------------------------------


def _unit() -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
        else:
            key, _, value = line.partition("=")
            sections[current].append((key.strip(), value.strip()))
    return sections


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min)?", value)
    assert m, f"unsupported time span {value!r}"
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def test_systemd_unit() -> None:
    unit = _unit()
    service = dict(unit["Service"])  # last value wins, as in systemd
    assert re.search(r"/kvxferd serve --config (\S+)$", service["ExecStart"]), service["ExecStart"]
    assert service["ExecStart"].endswith("--config /etc/kvxferd/kvxferd.toml")
    assert service["Type"] == "simple"
    assert service["Restart"] == "on-failure"
    assert service["LimitMEMLOCK"] == "infinity"
    assert service.get("EnvironmentFile", "").lstrip("-") == "/etc/kvxferd/kvxferd.env"
    assert service.get("User") and service["User"] != "root"
    # Settings that hide or close /dev/infiniband and /dev/nvidia*, or break CUDA.
    for key in ("PrivateDevices", "ProtectClock", "MemoryDenyWriteExecute", "PrivateIPC"):
        assert service.get(key, "no") in ("no", "false", "0"), f"{key} breaks RDMA/CUDA"
    assert "DeviceAllow" not in service and "DevicePolicy" not in service
    drain = load_config(UNIT_CONFIG, env=TOKEN_ENV).server.drain_timeout_s
    assert _seconds(service["TimeoutStopSec"]) > drain
    assert unit["Install"] == [("WantedBy", "multi-user.target")]
    socket_dir = Path(load_config(UNIT_CONFIG, env=TOKEN_ENV).server.engine_socket).parent
    assert socket_dir == Path("/run") / service["RuntimeDirectory"]


# --- Kubernetes ------------------------------------------------------------------------


def _k8s_docs() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_k8s_manifests_mention_grpc_port_and_probes_without_yaml() -> None:
    text = (K8S / "worker.yaml").read_text()
    assert "containerPort: 50051" in text and "containerPort: 9400" in text
    for probe in ("livenessProbe", "readinessProbe"):
        assert re.search(rf"{probe}:\s*\n\s*grpc:\s*\n\s*port: 50051", text), probe
    assert "IPC_LOCK" in text and "hostIPC" in text
    assert "clusterIP: None" in (K8S / "service.yaml").read_text()


def test_k8s_sidecar_matches_its_config() -> None:
    docs = _k8s_docs()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    cm = tomllib.loads(_configmap_toml())
    _, grpc_port = split_hostport(cm["server"]["listen"], "server.listen")
    _, metrics_port = split_hostport(cm["server"]["metrics_listen"], "server.metrics_listen")

    pod = by_kind["Deployment"][0]["spec"]["template"]
    spec = pod["spec"]
    containers = spec.get("initContainers", []) + spec["containers"]
    (sidecar,) = [c for c in containers if c["name"] == "kvxferd"]
    assert sidecar["args"] == ["serve", "--config", "/etc/kvxferd/kvxferd.toml"]
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["grpc"]["port"] == grpc_port, probe
    # Readiness = the Peer service (NOT_SERVING until an engine attached); start-up and
    # liveness = the overall service, or the engine (started after the sidecar) never starts.
    assert sidecar["readinessProbe"]["grpc"]["service"] == PEER_SERVICE
    assert "service" not in sidecar["startupProbe"]["grpc"]
    assert "service" not in sidecar["livenessProbe"]["grpc"]
    # The GPU: one DRA claim, listed by the sidecar and every engine container; no
    # device-plugin GPU (it would reach one container only).
    (claim,) = spec["resourceClaims"]
    template = by_kind["ResourceClaimTemplate"][0]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["count"] == 1
    for c in containers:
        res = c.get("resources", {})
        assert {"name": claim["name"]} in res.get("claims", []), c["name"]
        assert "nvidia.com/gpu" not in res.get("limits", {}), c["name"]
    assert "IPC_LOCK" in sidecar["securityContext"]["capabilities"]["add"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)
    assert spec["terminationGracePeriodSeconds"] > cm["server"]["drain_timeout_s"]

    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert volumes[mounts["/etc/kvxferd"]]["configMap"]["name"] == "kvxferd-config"
    token_dir = str(Path(cm["auth"]["token_file"]).parent)
    assert "secret" in volumes[mounts[token_dir]], "auth.token_file must come from a Secret"
    socket_dir = str(Path(cm["server"]["engine_socket"]).parent)
    assert "emptyDir" in volumes[mounts[socket_dir]]
    engines = [c for c in spec["containers"] if c["name"] != "kvxferd"]
    assert engines and all(
        any(m["name"] == mounts[socket_dir] for m in c.get("volumeMounts", [])) for c in engines
    ), "the engine container must mount the Engine socket's emptyDir"

    (svc,) = by_kind["Service"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    svc_ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert svc_ports["grpc"] == grpc_port
    (sm,) = by_kind["ServiceMonitor"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= svc_ports.keys()
    (kust,) = by_kind["Kustomization"]
    assert all((K8S / r).is_file() for r in kust["resources"])


def test_tcp_port_serves_no_engine_service() -> None:
    assert PEER_SERVICE == "kvxferd.v1.Peer"
    assert "kvxferd.v1.Engine" not in TCP_SERVICES


# --- Docker ----------------------------------------------------------------------------


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.12-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert 'pip install "/src[${NIXL_EXTRA}]"' in text  # exactly one NIXL extra
    assert re.search(r"^ARG NIXL_EXTRA=cu13$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["kvxferd"\]$', text, re.M)
    assert re.search(r'^CMD \["serve", "--config", "/etc/kvxferd/kvxferd.toml"\]$', text, re.M)
    assert re.search(r"^EXPOSE 50051 9400$", text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    for src in re.findall(r"^COPY (deploy/\S+)", text, re.M):
        assert (ROOT / src).is_file(), src
        assert f"!{src}" in DOCKERIGNORE.read_text(), f"{src} is excluded by .dockerignore"


def test_dockerignore() -> None:
    lines = {
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    for pattern in (".venv", ".git", "*.whl", "node_modules", ".mypy_cache", ".pytest_cache"):
        assert pattern in lines, pattern
    for needed in ("kvxferd", "pyproject.toml", "README.md"):
        assert needed not in lines, f"{needed} is needed by pip install"
