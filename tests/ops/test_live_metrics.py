"""Operability against live daemons (issue 16's acceptance).

Four real ``kvxferd serve`` processes: a prefill owner with a staging ring, a decode daemon
that pulls DIRECT, one that pulls STAGED, and one whose KV layout differs (its handshake is
refused). After DONE, FAILED and refused pulls:

* every series the Grafana dashboard and the alert rules use exists in what the daemons
  serve on ``/metrics``, with a sample matching the query's label matchers (the names are
  checked against live output, not against ``kvxferd.metrics``);
* the series a pull must move have moved (bytes, per-peer outcomes, per-RPC counts, ...);
* docs/operations.md lists every ``kvxferd_*`` family the daemons serve, with its type and
  labels;
* with Prometheus installed (Debian: ``apt-get install prometheus``; ``.ci/run`` installs
  it), a real Prometheus scrapes the daemons during the traffic, and every dashboard query
  returns data without NaN, and every alert expression evaluates.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grpc import aio
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.scenario.ports import free_port
from kvxferd.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.service.conftest import Daemons, launch

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvxferd-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvxferd-alerts.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
ROW = 32 * 65536  # one dense block row: 32 layers x 64 KiB
TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}
SELECTOR_RE = re.compile(r"\b(kvxferd_[a-z0-9_]+)\s*(?:\{([^}]*)\})?")
MATCHER_RE = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
PROMETHEUS = shutil.which("prometheus")


def _staging(strategy: str) -> tuple[str, ...]:
    return (
        "--set",
        f"transfer.strategy={strategy}",
        "--set",
        f"transfer.staging_chunk_bytes={2 * ROW}",
        "--set",
        "transfer.staging_chunks=2",
    )


def _ids(ids: list[int]) -> common_pb2.GroupBlockIds:
    return common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=ids)])


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
    return body.decode()


class PromServer:
    """A real Prometheus on loopback scraping the daemons every second."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {"job_name": "kvxferd", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        assert PROMETHEUS
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={cfg}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "prometheus did not start:\n" + self.log.read_text()[-3000:]
                    ) from None
                time.sleep(0.2)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        doc = json.loads(_get(url))
        assert doc["status"] == "success", (expr, doc)
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def wait_scrapes(self, n: int, timeout_s: float = 60.0) -> None:
        """Until every target has ``n`` scrapes in the last minute."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            res = self.query("min(count_over_time(up[1m]))")
            if res and float(res[0]["value"][1]) >= n:
                return
            time.sleep(0.5)
        raise AssertionError(f"prometheus did not scrape {n} times in {timeout_s}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class World:
    daemons: Daemons
    scrapes: dict[str, str]  # daemon name -> /metrics text after the traffic
    prom: PromServer | None


async def _traffic(ds: Daemons, first: bool) -> None:
    """DIRECT and STAGED pulls; the first round also a FAILED pull and a refused one."""
    prefill, direct, staged, odd = ds["prefill"], ds["direct"], ds["staged"], ds["odd"]
    async with (
        aio.insecure_channel(f"unix:{prefill.engine_socket}") as pe,
        aio.insecure_channel(f"unix:{odd.engine_socket}") as oe,
        aio.insecure_channel(direct.grpc) as dc,
        aio.insecure_channel(staged.grpc) as sc,
    ):
        engine = engine_pb2_grpc.EngineStub(pe)

        async def hold(rid: str, ids: list[int]) -> engine_pb2.HoldResponse:
            resp: engine_pb2.HoldResponse = await engine.Hold(
                engine_pb2.HoldRequest(request_id=rid, block_ids=_ids(ids), expected_readers=1)
            )
            return resp

        async def pull(
            stub: scheduler_pb2_grpc.SchedulerStub,
            rid: str,
            peer: str,
            remote: common_pb2.GroupBlockIds,
            local: list[int],
        ) -> scheduler_pb2.TransferStatus:
            resp = await stub.StartPull(
                scheduler_pb2.StartPullRequest(
                    request_id=rid,
                    peer_address=peer,
                    remote_block_ids=remote,
                    local_block_ids=_ids(local),
                    deadline_ms=20000,
                )
            )
            watch = stub.WatchTransfers(
                scheduler_pb2.WatchTransfersRequest(transfer_ids=[resp.status.transfer_id])
            )
            async for msg in watch:
                if msg.status.state in TERMINAL:
                    watch.cancel()
                    return msg.status
            raise AssertionError("watch ended early")

        d_stub = scheduler_pb2_grpc.SchedulerStub(dc)
        s_stub = scheduler_pb2_grpc.SchedulerStub(sc)
        for i in range(3 if first else 1):
            held = await hold(f"direct-{first}-{i}", [3 * i, 3 * i + 1, 40 + i])
            st = await pull(d_stub, held.request_id, held.peer_address, held.remote_block_ids,
                            [10 + i, 20 + i, 30 + i])  # fmt: skip
            assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
            assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_DIRECT
        held = await hold(f"staged-{first}", [5, 9, 13, 17, 21])
        st = await pull(s_stub, held.request_id, held.peer_address, held.remote_block_ids,
                        [1, 7, 19, 33, 50])  # fmt: skip
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED
        if not first:
            return
        # FAILED: the owner holds no such request (the lease confirmation is refused).
        st = await pull(d_stub, "never-held", held.peer_address, _ids([1, 2]), [3, 4])
        assert st.state == scheduler_pb2.TRANSFER_STATE_FAILED
        # Refused handshake: the odd daemon's layout differs.
        odd_held: engine_pb2.HoldResponse = await engine_pb2_grpc.EngineStub(oe).Hold(
            engine_pb2.HoldRequest(request_id="odd-0", block_ids=_ids([0, 1]), expected_readers=1)
        )
        try:
            st = await pull(d_stub, "odd-0", odd_held.peer_address, odd_held.remote_block_ids,
                            [2, 3])  # fmt: skip
            assert st.state == scheduler_pb2.TRANSFER_STATE_FAILED
        except aio.AioRpcError:
            pass  # refused at StartPull: also fine, the handshake was counted


def _wait_leases_released(url: str, timeout_s: float = 10.0) -> None:
    """Until the daemon at ``url`` holds no lease (its READ_DONE notifications arrived)."""
    end = time.monotonic() + timeout_s
    while True:
        held = [
            s.value
            for f in text_string_to_metric_families(_get(url))
            for s in f.samples
            if s.name == "kvxferd_leases_active"
        ]
        if held == [0.0] or time.monotonic() > end:
            return  # past the timeout, the assertions on the scrape say what is left
        time.sleep(0.05)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("ops")
    ds = launch(
        tmp,
        DaemonOptions("prefill", "dense:num_blocks=64", fill_seed=7, extra=_staging("auto")),
        DaemonOptions("direct", "dense:num_blocks=64", extra=_staging("direct")),
        DaemonOptions("staged", "dense:num_blocks=64", extra=_staging("staged")),
        DaemonOptions("odd", "mla:num_blocks=16"),
        DaemonOptions("attached", "dense", extra=("--set", "pool.mode=attached")),
    )
    prom = None
    try:
        names = ("prefill", "direct", "staged", "odd", "attached")
        if PROMETHEUS:
            prom = PromServer(tmp, [ds[n].metrics for n in names])
            prom.wait_scrapes(2)
        asyncio.run(_traffic(ds, first=True))
        # A series born during the traffic has no earlier sample: rate() sees its first
        # increment only once it was scraped before the next one. Scrape, then pull again.
        time.sleep(2.5 if prom is not None else 0)
        asyncio.run(_traffic(ds, first=False))
        if prom is not None:
            time.sleep(3)  # a few scrapes after the traffic
        # A reader's pull is DONE when its READ completes; the owner ends that reader's share
        # when the READ_DONE notification arrives, a moment later. Scrape once it has.
        _wait_leases_released(f"http://{ds['prefill'].metrics}/metrics")
        scrapes = {n: _get(f"http://{ds[n].metrics}/metrics") for n in names}
        yield World(ds, scrapes, prom)
    finally:
        if prom is not None:
            prom.stop()
        ds.stop()


# --- what the daemons serve --------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _samples(text: str) -> list[Sample]:
    return [
        Sample(s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def _families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """family -> (type, label names) as served (``le``/``quantile`` left out)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in text_string_to_metric_families(text):
        labels = {k for s in fam.samples for k in s.labels} - {"le", "quantile"}
        out[fam.name] = (fam.type, frozenset(labels))
    return out


def _all_samples(w: World) -> list[Sample]:
    return [s for text in w.scrapes.values() for s in _samples(text)]


def _value(w: World, daemon: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in _samples(w.scrapes[daemon])
        if s.name == name and labels.items() <= s.labels.items()
    )


# --- the dashboard's and the alerts' queries -----------------------------------------------


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def panels(ps: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dash["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p.get('title')!r}", t["expr"]))
    for v in dash["templating"]["list"]:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v["type"] == "query" and q:
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            out.append((f"variable {v['name']}", inner.group(1) if inner else q))
    return out


def _alert_exprs() -> list[tuple[str, str]]:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(ALERTS.read_text())
    return [(f"alert {r['alert']}", str(r["expr"])) for g in doc["groups"] for r in g["rules"]]


def _matches(sample: Sample, matchers: list[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        if "$" in value or label in ("job", "instance"):
            continue  # dashboard variables; target labels Prometheus adds
        got = sample.labels.get(label, "")
        rx = re.compile(value)
        ok = {
            "=": got == value,
            "!=": got != value,
            "=~": bool(rx.fullmatch(got)),
            "!~": not rx.fullmatch(got),
        }[op]
        if not ok:
            return False
    return True


def test_every_series_the_dashboard_and_alerts_use_is_served_with_data(world: World) -> None:
    samples = _all_samples(world)
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    exprs = _dashboard_exprs() + _alert_exprs()
    assert len(exprs) >= 25
    checked = 0
    for where, expr in exprs:
        for name, body in SELECTOR_RE.findall(expr):
            served = by_name.get(name)
            assert served, f"{where}: {name} is not served by any live daemon ({expr})"
            matchers = MATCHER_RE.findall(body)
            assert any(_matches(s, matchers) for s in served), (
                f"{where}: no live sample of {name} matches {{{body}}}; served label sets:"
                f" {sorted({tuple(sorted(s.labels.items())) for s in served})[:8]}"
            )
            checked += 1
    assert checked >= 40


def test_a_pull_moves_the_series_it_should(world: World) -> None:
    w = world
    assert _value(w, "direct", "kvxferd_transfers_total", state="DONE", strategy="DIRECT") == 4
    assert _value(w, "staged", "kvxferd_transfers_total", state="DONE", strategy="STAGED") == 2
    assert _value(w, "direct", "kvxferd_transfers_total", state="FAILED") >= 1
    assert _value(w, "direct", "kvxferd_transfer_bytes_total") == 12 * ROW
    assert _value(w, "staged", "kvxferd_strategy_bytes_total", strategy="STAGED") == 10 * ROW
    assert _value(w, "staged", "kvxferd_staged_chunks_count") == 2
    assert _value(w, "staged", "kvxferd_staged_stage_seconds_count", stage="read") == 2
    # Per peer: outcome and latency, labelled with the owner's address.
    prefill = w.daemons["prefill"].grpc
    assert _value(w, "direct", "kvxferd_peer_pulls_total", peer=prefill, state="DONE") == 4
    assert _value(w, "direct", "kvxferd_peer_pull_duration_seconds_count", peer=prefill) >= 5
    assert _value(w, "direct", "kvxferd_inflight_bytes", peer=prefill) == 0
    # Post time apart from transfer time; handshake latency on both sides.
    for stage in ("post", "transfer", "handshake"):
        assert _value(w, "direct", "kvxferd_pull_stage_seconds_count", stage=stage) == 4, stage
    assert _value(w, "direct", "kvxferd_handshake_duration_seconds_count", side="client") >= 2
    assert _value(w, "prefill", "kvxferd_handshake_duration_seconds_count", side="server") >= 2
    # Per-RPC counts (server and client side).
    # StartPull: 4 DONE, 1 FAILED later, 1 refused (FAILED_PRECONDITION, or FAILED later).
    assert _value(w, "direct", "kvxferd_rpcs_total", method="StartPull") == 6
    assert _value(w, "direct", "kvxferd_rpcs_total", method="StartPull", code="OK") >= 5
    assert _value(w, "direct", "kvxferd_rpcs_total", method="StartPull", code="INTERNAL") == 0
    assert _value(w, "prefill", "kvxferd_rpcs_total", method="Hold", code="OK") == 6
    # Each counted READ_DONE, from its share's grant, on the owner.
    assert _value(w, "prefill", "kvxferd_lease_read_seconds_count") >= 4
    assert _value(w, "direct", "kvxferd_peer_rpcs_total", method="Handshake", code="OK") >= 1
    assert _value(w, "direct", "kvxferd_rpc_duration_seconds_count", method="StartPull") == 6
    # Refused handshake, seen as a link state and a handshake result.
    assert _value(w, "direct", "kvxferd_peers", state="REFUSED") == 1
    assert _value(w, "direct", "kvxferd_peers", state="READY") == 1
    assert _value(w, "direct", "kvxferd_handshakes_total", result="refused") >= 1
    # Registered memory: the KV pool apart from the staging ring.
    assert _value(w, "prefill", "kvxferd_registered_bytes") == 64 * ROW
    assert _value(w, "prefill", "kvxferd_staging_ring_bytes") == 2 * 2 * ROW
    assert _value(w, "odd", "kvxferd_staging_ring_bytes") > 0  # default ring
    assert _value(w, "prefill", "kvxferd_staging_slots", use="free") == 2
    # Nothing held any more; no pull waiting or running.
    assert _value(w, "prefill", "kvxferd_leases_active") == 0  # every hold was read
    assert _value(w, "odd", "kvxferd_leases_active") == 1  # odd-0: its pull was refused
    assert _value(w, "direct", "kvxferd_pulls") == 0
    # Build and process.
    (info,) = [s for s in _samples(w.scrapes["direct"]) if s.name == "kvxferd_build_info"]
    assert info.value == 1 and info.labels["version"] and info.labels["grpcio"]
    assert _value(w, "direct", "process_resident_memory_bytes") > 0


def test_operations_doc_lists_every_served_family(world: World) -> None:
    """docs/operations.md has a row ``| `name` | type | labels | ...`` per kvxferd family."""
    served: dict[str, tuple[str, frozenset[str]]] = {}
    for text in world.scrapes.values():
        for name, (kind, labels) in _families(text).items():
            served[name] = (kind, labels | served.get(name, (kind, frozenset()))[1])
    rows = {}
    for line in OPERATIONS.read_text().splitlines():
        m = re.match(r"\|\s*`(kvxferd_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            labels = frozenset(re.findall(r"`(\w+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels)
    mine = {k: v for k, v in served.items() if k.startswith("kvxferd_")}
    missing = sorted(mine.keys() - rows.keys())
    assert not missing, f"docs/operations.md lacks rows for {missing}"
    stale = sorted(rows.keys() - mine.keys())
    assert not stale, f"docs/operations.md lists families no daemon serves: {stale}"
    for name, (kind, labels) in mine.items():
        assert rows[name] == (kind, labels), (name, rows[name], (kind, labels))


# --- a real Prometheus ----------------------------------------------------------------------

needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed")
SUBST = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*"}


@needs_prometheus
def test_every_dashboard_query_returns_data_without_nan(world: World) -> None:
    assert world.prom is not None
    empty, nan = [], []
    for where, expr in _dashboard_exprs():
        q = expr
        for k, v in SUBST.items():
            q = q.replace(k, v)
        result = world.prom.query(q)
        if not result:
            empty.append(f"{where}: {expr}")
        elif any(math.isnan(float(r["value"][1])) for r in result):
            nan.append(f"{where}: {expr} -> {result}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert not nan, "queries with NaN:\n" + "\n".join(nan)


@needs_prometheus
def test_alert_expressions_evaluate_and_their_series_exist(world: World) -> None:
    assert world.prom is not None
    for where, expr in _alert_exprs():
        world.prom.query(expr)  # evaluates (status success), firing or not
        for name, body in SELECTOR_RE.findall(expr):
            sel = f"{name}{{{body}}}" if body else name
            assert world.prom.query(sel), f"{where}: {sel} has no data in Prometheus"
    up = world.prom.query('up{job=~".*kvxferd.*"} == 1')
    assert len(up) == 5


# --- listeners: reflection and health -------------------------------------------------------


async def _reflected(target: str) -> set[str]:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def ask() -> Any:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async with aio.insecure_channel(target) as ch:
        names: set[str] = set()
        async for resp in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(ask()):
            names |= {s.name for s in resp.list_services_response.service}
        return names


def test_reflection_lists_only_what_each_listener_serves(world: World) -> None:
    d = world.daemons["prefill"]
    refl = "grpc.reflection.v1alpha.ServerReflection"
    tcp = asyncio.run(_reflected(d.grpc))
    assert tcp == {"kvxferd.v1.Peer", "kvxferd.v1.Scheduler", "grpc.health.v1.Health", refl}
    unix = asyncio.run(_reflected(f"unix:{d.engine_socket}"))
    assert unix == {"kvxferd.v1.Engine", refl}


def test_readiness_is_the_peer_service_in_attached_mode(world: World) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def status(target: str, service: str) -> int:
        async with aio.insecure_channel(target) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service)
            )
            return int(resp.status)

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    attached, owned = world.daemons["attached"].grpc, world.daemons["prefill"].grpc
    assert asyncio.run(status(attached, "")) == serving  # liveness
    assert asyncio.run(status(attached, "kvxferd.v1.Peer")) == not_serving  # not ready
    assert asyncio.run(status(attached, "kvxferd.v1.Scheduler")) == serving
    assert asyncio.run(status(owned, "kvxferd.v1.Peer")) == serving
    with pytest.raises(aio.AioRpcError):  # the TCP port does not serve Engine
        asyncio.run(status(owned, "kvxferd.v1.Engine"))


# --- logs ---------------------------------------------------------------------------------


def test_daemon_logs_are_json_objects_with_fields(world: World) -> None:
    """Every line a daemon wrote (stdout and stderr) is one JSON object, NIXL's own lines
    included; messages carry no ``event=...`` text in the modules converted so far."""
    converted = ("kvxferd.nixl", "kvxferd.attach", "kvxferd.kernels", "kvxferd.staging")
    nixl_lines = 0
    for d in world.daemons.set:
        for raw in d.log_path.read_text().splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                raise AssertionError(f"{d.name}: not a JSON line: {raw!r}") from None
            assert {"ts", "level", "logger", "msg"} <= rec.keys(), rec
            if rec["logger"].startswith(converted):
                assert "event=" not in rec["msg"], rec
            nixl_lines += rec["logger"].startswith("nixl")
    assert nixl_lines >= 5  # NIXL's "Backend UCX was instantiated" etc., one set per daemon


def test_native_output_becomes_log_records(tmp_path: Path) -> None:
    code = """
import logging, os, sys
from kvxferd.logs import setup_logging
setup_logging("INFO", "json")
os.write(2, b"E1123 12:00:00.000000 77 core.cc:1] native failure\\n")
os.write(1, b"plain stdout line\\n")
os.write(2, b"[1700000000.1] [h:1:2] ucp_ep.c:1 UCX  WARN  a native warning\\n")
print("kvxferd: error: a CLI line stays plain", file=sys.stderr)
import warnings
warnings.warn("a library warning")
logging.getLogger("kvxferd.test").info("own", extra={"kv": {"n": 1}})
"""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert "kvxferd: error: a CLI line stays plain" in lines  # Python's own stderr
    recs = [json.loads(x) for x in lines if x.startswith("{")]
    assert len(recs) == len(lines) - 1 and not res.stdout, res.stdout + res.stderr
    by_msg = {r["msg"]: r for r in recs}
    native = by_msg["E1123 12:00:00.000000 77 core.cc:1] native failure"]
    assert native["level"] == "warning" and native["native_level"] == "error"
    assert native["logger"] == "kvxferd.native" and native["stream"] == "stderr"
    assert by_msg["plain stdout line"]["stream"] == "stdout"
    assert by_msg["plain stdout line"]["level"] == "info"
    warn = by_msg["[1700000000.1] [h:1:2] ucp_ep.c:1 UCX  WARN  a native warning"]
    assert warn["level"] == "warning" and warn["native_level"] == "warning"
    assert by_msg["own"]["n"] == 1
    (pywarn,) = [r for r in recs if r["logger"] == "py.warnings"]
    assert "a library warning" in pywarn["msg"] and pywarn["level"] == "warning"
