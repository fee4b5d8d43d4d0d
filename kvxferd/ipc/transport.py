"""Which transport serves READs from a peer, measured at connect; refusing GPU reads at TCP speed.

UCX picks its transport per memory-type pair on its own, and on a GPU without NVLink the UCX
1.23 inside nixl-cu13 turns cuda_ipc GET zero-copy off: every VRAM READ then travels as active
messages over TCP loopback, correct but ~3,000 times slower than the copy (docs/nixl.md §7),
and nothing says so. So after a handshake the reader times **one probe READ** of the peer's
first registered region into one slot of its own staging ring (taken like any chunk's slot; no
KV block is touched) and classifies the link (:func:`classify`):

* VRAM to VRAM below :data:`SLOW_GBPS`: ``tcp`` (active messages; the only path that slow),
  refused for DIRECT and STAGED pulls unless ``transfer.allow_slow_transport`` (KERNEL pulls do
  not use UCX and are unaffected);
* VRAM to VRAM above it: ``cuda_ipc`` on one host, ``rdma`` across hosts;
* host memory: ``cma`` on one host (``tcp`` below :data:`SLOW_DRAM_GBPS`), ``rdma`` or ``tcp``
  across hosts by the same thresholds.

The name is *inferred* from the measured rate, the memory types and whether the peers share a
host (NIXL does not expose UCX's lane choice); the rate itself is a measurement. For the exact
UCX lanes, run the daemons with ``UCX_PROTO_INFO=y``. Without a staging ring on this side there
is no scratch memory to probe into, and the transport is ``unknown``; so it is for a peer whose
pool is served by KERNEL only (``HandshakePayload.kernel_only_reason``: its regions are not
registered with NIXL, so there is nothing a READ could probe).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.errors import DeadlineExceeded, KvxferdError, SlowTransport
from kvxferd.logs import kv
from kvxferd.nixl.types import MemType

if TYPE_CHECKING:
    from kvxferd.nixl import NixlAgent
    from kvxferd.staging.ring import StagingRing

log = logging.getLogger(__name__)

SLOW_GBPS = 2.0  # VRAM: cuda_ipc and RDMA move a probe at >= ~10 GB/s, TCP at ~0.4
SLOW_DRAM_GBPS = 0.3
PROBE_BYTES = 8 << 20
PROBE_TIMEOUT_S = 2.0
GET_ZCOPY_FIX = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"


@dataclass(frozen=True)
class TransportReport:
    """What serves READs from one peer into this daemon."""

    name: str  # cuda_ipc, rdma, tcp, cma or unknown
    read_gbps: float  # the probe READ's rate; NaN when not probed
    same_host: bool
    local_vram: bool
    remote_vram: bool
    detail: str

    @property
    def slow(self) -> bool:
        """A VRAM-to-VRAM link at TCP speed."""
        return self.local_vram and self.remote_vram and self.name == "tcp"

    def describe(self) -> str:
        rate = "not probed" if math.isnan(self.read_gbps) else f"{self.read_gbps:.2f} GB/s"
        return f"{self.name} ({rate})"


def classify(
    *,
    local_vram: bool,
    remote_vram: bool,
    same_host: bool,
    gbps: float,
    nbytes: int = PROBE_BYTES,
    why_not: str = "",
) -> TransportReport:
    """Name the transport from the probe's rate (``gbps``; NaN: not probed, ``why_not``)."""
    where = "same host" if same_host else "another host"
    kind = f"{'VRAM' if remote_vram else 'DRAM'} -> {'VRAM' if local_vram else 'DRAM'}"
    if math.isnan(gbps):
        return TransportReport(
            "unknown", gbps, same_host, local_vram, remote_vram, f"{kind}, {where}: {why_not}"
        )
    vram = local_vram and remote_vram
    slow = gbps < (SLOW_GBPS if vram else SLOW_DRAM_GBPS)
    if slow:
        name = "tcp"
    elif vram or local_vram or remote_vram:
        name = "cuda_ipc" if same_host else "rdma"
    else:
        name = "cma" if same_host else "rdma"
    detail = (
        f"{kind}, {where}: a probe READ of {nbytes} bytes ran at {gbps:.2f} GB/s; the name is"
        " inferred from that rate (UCX_PROTO_INFO=y shows UCX's own lanes)"
    )
    return TransportReport(name, gbps, same_host, local_vram, remote_vram, detail)


def refusal(report: TransportReport, peer: str, strategy: str) -> SlowTransport:
    """The error for a DIRECT or STAGED pull over a slow VRAM link."""
    return SlowTransport(
        f"a {strategy} pull from {peer} would read GPU memory over {report.name} at"
        f" {report.read_gbps:.2f} GB/s ({report.detail}), thousands of times slower than the GPU"
        " copy",
        field="peer_address",
        fix=f"set {GET_ZCOPY_FIX} in both daemons' environment (kvxferd sets it itself on a GPU"
        " without NVLink unless the variable is set; see the 'ucx environment' log line), or run"
        " both daemons on one host with transfer.cuda_ipc = true (KERNEL pulls), or accept this"
        " speed with transfer.allow_slow_transport = true",
    )


async def probe_read(
    agent: NixlAgent,
    *,
    peer: str,
    local: tuple[int, int],
    remote: tuple[int, int],
    nbytes: int,
    local_mem: MemType,
    remote_mem: MemType,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> float:
    """Seconds of one READ of ``nbytes`` from ``remote`` ``(addr, dev)`` into ``local``
    ``(addr, dev)``, timed after one untimed READ (which makes UCX connect and map)."""
    from kvxferd.nixl import XferOp, XferState

    loc = np.array([[local[0], nbytes, local[1]]], dtype=np.int64)
    rem = np.array([[remote[0], nbytes, remote[1]]], dtype=np.int64)

    def one(deadline: float) -> float:
        t0 = time.perf_counter()
        h = agent.post(XferOp.READ, loc, rem, peer=peer, local_mem=local_mem, remote_mem=remote_mem)
        try:
            while agent.poll(h) is not XferState.DONE:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"a {nbytes}-byte probe READ from {peer} did not finish in {timeout_s}s",
                        fix="check the peer's health; UCX_LOG_LEVEL=info shows the transports",
                    )
            return time.perf_counter() - t0
        finally:
            agent.release(h)

    def both() -> float:
        deadline = time.monotonic() + timeout_s
        one(deadline)
        return one(deadline)

    return await asyncio.to_thread(both)


async def probe_peer(
    agent: NixlAgent,
    ring: StagingRing | None,
    *,
    peer_agent: str,
    remote_region: tuple[int, int, int],
    local_vram: bool,
    remote_vram: bool,
    same_host: bool,
    kernel_only: str = "",
) -> TransportReport:
    """Probe READs from ``peer_agent`` (its region ``(addr, len, dev)``) into one slot of our
    ring and classify the link; never raises (an unprobed link is ``unknown``, with why).
    ``kernel_only``: the peer's reason for serving KERNEL only (nothing is probed then)."""

    def report(gbps: float, nbytes: int = PROBE_BYTES, why_not: str = "") -> TransportReport:
        return classify(
            local_vram=local_vram,
            remote_vram=remote_vram,
            same_host=same_host,
            gbps=gbps,
            nbytes=nbytes,
            why_not=why_not,
        )

    if kernel_only:
        return report(
            math.nan,
            why_not=f"the peer serves KERNEL pulls only ({kernel_only}): no NIXL READ to probe",
        )
    if ring is None:
        return report(
            math.nan,
            why_not="this daemon has no staging ring to probe into (transfer.staging_chunks = 0)",
        )
    addr, length, dev = remote_region
    n = min(PROBE_BYTES, ring.info.chunk_bytes, length)
    local_mem = MemType.VRAM if local_vram else MemType.DRAM
    remote_mem = MemType.VRAM if remote_vram else MemType.DRAM
    try:
        async with ring.reader_slot() as slot:
            seconds = await probe_read(
                agent,
                peer=peer_agent,
                local=(ring.info.base + ring.info.slot_offset(slot), ring.info.device),
                remote=(addr, dev),
                nbytes=n,
                local_mem=local_mem,
                remote_mem=remote_mem,
            )
    except KvxferdError as err:
        log.warning("transport probe failed", extra=kv(peer=peer_agent, error=str(err)))
        return report(math.nan, why_not=f"the probe READ failed: {err}")
    return report(n / seconds / 1e9 if seconds > 0 else math.inf, n)
