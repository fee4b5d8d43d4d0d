"""What ``kvxferd demo`` reports: one :class:`RequestResult` per request, the line printed as
it ends, the running totals of the progress bar, and the summary (JSON fields and the table per
kind and pattern).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvxferd.scenario.report import fmt, human_bytes, percentile, table


@dataclass
class RequestResult:
    """What happened to one request (one row of the JSON's ``per_request``)."""

    index: int
    kind: str
    pattern: str
    tokens: int
    cached_tokens: int
    full_hit: bool
    request_id: str
    transfer_id: str
    local_blocks: list[int] = field(default_factory=list)  # logical, per group
    remote_blocks: list[int] = field(default_factory=list)
    requested_blocks: int = 0  # paired kernel blocks, all groups
    verified_blocks: int = 0
    changed_blocks: int = 0
    preloaded_blocks: int = 0
    ambiguous_blocks: int = 0
    state: str = ""
    nbytes: int = 0
    planned_nbytes: int = 0
    descriptors_naive: int = 0
    descriptors_posted: int = 0
    latency_ms: float = math.nan
    server_ms: float = math.nan
    started_at: float = math.nan  # time.perf_counter() at StartPull
    ended_at: float = math.nan  # time.perf_counter() when the terminal status arrived
    via: str = ""
    released: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and self.state == "DONE"


def request_line(res: RequestResult) -> str:
    """The line printed when a request ends."""
    lat = f"{res.latency_ms:8.2f} ms" if math.isfinite(res.latency_ms) else "       - ms"
    verdict = "ok" if res.ok else "FAILED: " + "; ".join(res.errors)
    return (
        f"request {res.index + 1:>3}  {res.kind:<10} {res.pattern:<10}"
        f" {res.tokens:>6} tok  {res.verified_blocks:>5}/{res.requested_blocks:<5} blocks"
        f"  {human_bytes(res.nbytes):>10}  {lat}  {res.state or '-':<9} {verdict}"
    )


def progress_text(results: list[RequestResult]) -> str:
    """The progress bar's running totals."""
    nbytes = sum(r.nbytes for r in results)
    lat = [r.latency_ms for r in results if math.isfinite(r.latency_ms)]
    fails = sum(1 for r in results if r.errors)
    p50 = f"p50 {percentile(lat, 50):.1f} ms" if lat else ""
    return f"{human_bytes(nbytes)} pulled  {p50}  {fails} failed"


def summarize(results: list[RequestResult], busy_s: float) -> dict[str, Any]:
    done = [r for r in results if r.state == "DONE"]
    lat = [r.latency_ms for r in done if math.isfinite(r.latency_ms)]
    srv = [r.server_ms for r in done if math.isfinite(r.server_ms)]
    nbytes = sum(r.nbytes for r in done)
    return {
        "requests": len(results),
        "requests_done": len(done),
        "requested_blocks": sum(r.requested_blocks for r in results),
        "verified_blocks": sum(r.verified_blocks for r in results),
        "changed_blocks": sum(r.changed_blocks for r in results),
        "preloaded_blocks": sum(r.preloaded_blocks for r in results),
        "ambiguous_blocks": sum(r.ambiguous_blocks for r in results),
        "bytes": nbytes,
        "busy_s": busy_s,
        "throughput_gbps": nbytes / busy_s / 1e9 if busy_s > 0 else math.nan,
        "latency_ms": {
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "max": max(lat) if lat else math.nan,
        },
        "server_latency_ms": {"p50": percentile(srv, 50), "p99": percentile(srv, 99)},
        "descriptors": {
            "naive": sum(r.descriptors_naive for r in done),
            "posted": sum(r.descriptors_posted for r in done),
        },
        "failed_requests": sum(1 for r in results if not r.ok),
    }


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summary_table(results: list[RequestResult]) -> str:
    groups: dict[tuple[str, str], list[RequestResult]] = {}
    for r in results:
        groups.setdefault((r.kind, r.pattern), []).append(r)
    rows = []
    for (kind, pattern), rs in [*groups.items(), (("total", ""), results)]:
        done = [r for r in rs if r.state == "DONE"]
        lat = [r.latency_ms for r in done if math.isfinite(r.latency_ms)]
        busy = busy_seconds([(r.started_at, r.ended_at) for r in done])
        nbytes = sum(r.nbytes for r in done)
        rows.append(
            [
                kind,
                pattern,
                str(len(rs)),
                f"{sum(r.verified_blocks for r in rs)}/{sum(r.requested_blocks for r in rs)}",
                human_bytes(nbytes),
                fmt(nbytes / busy / 1e9 if busy > 0 else math.nan),
                fmt(percentile(lat, 50)),
                fmt(percentile(lat, 90)),
                fmt(percentile(lat, 99)),
                f"{sum(r.descriptors_naive for r in done):,}",
                f"{sum(r.descriptors_posted for r in done):,}",
                str(sum(1 for r in rs if not r.ok)),
            ]
        )
    headers = [
        "kind",
        "pattern",
        "reqs",
        "verified blocks",
        "bytes",
        "GB/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "descs naive",
        "descs posted",
        "failed",
    ]
    return table(headers, rows, left=2)
