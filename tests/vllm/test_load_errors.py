"""A failed pull's invalid blocks are logical block IDs, as the caller sent them
(scheduler.proto, ``invalid_local_block_ids``), and the vLLM connector's load errors are
vLLM's block IDs.

vLLM's ``get_block_ids_with_load_errors`` contract: the IDs are the KV cache manager's block
IDs, the ones the scheduler handed the connector in ``update_state_after_alloc`` (vLLM
compares them with ``kv_cache_manager.get_block_ids(request_id)`` to decide which requests
to recompute or fail). With kernel block splitting (kernel block size < vLLM's block size,
``ppl`` > 1, which the connector translates: docs/vllm.md) the daemon once reported a failed
pull's local *kernel* blocks, which the worker handed to vLLM unchanged.

Real daemons (attached mode, as beside a vLLM engine), the connector's own code paths
(``attach_shared``, ``RankHolds``, ``plan_pull``, ``RankWorker``/``PullLink``), a KV cache laid
out as vLLM lays it with 64-token blocks split into 32-token kernel blocks. A pull is cancelled
while its READ is in flight (so the daemon lists every local block it may have written).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from kvxferd.layout.spec import GroupKind
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.scenario.vllm_engines import DAEMON_EXTRA
from kvxferd.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvxferd.vllm.daemon import EngineLink
from kvxferd.vllm.holds import RankHolds
from kvxferd.vllm.host import attach_shared
from kvxferd.vllm.memory import SharedKvAllocation
from kvxferd.vllm.params import LocalBlock, blocks_to_hold, plan_pull, ticket_from_params
from kvxferd.vllm.pull_link import PullLink
from kvxferd.vllm.spec import kernel_block_sizes, translate
from kvxferd.vllm.worker import RankWorker
from tests.service.conftest import Daemons, launch
from tests.vllm.test_vllm_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

FA = [GroupKind.FULL_ATTENTION]
BLOCK = 64  # vLLM's (manager) block size, tokens
KERNEL = 32  # the attention kernel's block size: ppl 2
NUM_BLOCKS = 2048  # vLLM's blocks (4096 kernel blocks), 64 MiB per engine
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}


def split_config() -> KVCacheConfig:
    spec = FullAttentionSpec(BLOCK, 2, 32, torch.bfloat16)
    page = spec.page_size_bytes
    t = KVCacheTensor(page * NUM_BLOCKS * len(LAYERS), LAYERS, page * NUM_BLOCKS, page)
    return KVCacheConfig(NUM_BLOCKS, [t], [KVCacheGroupSpec(LAYERS, spec)], "LBHNC")


class SplitEngine:
    """One worker: vLLM's CPU-style KV cache in shared memory, viewed as ``[B, H, N, C]`` with
    ``B`` kernel blocks (each manager block split in two), attached to its daemon."""

    def __init__(self, socket: str, seed: int) -> None:
        self.cfg = split_config()
        self.alloc = SharedKvAllocation(prefix="kvxferd-load-errors")
        t0 = translate(self.cfg, model="m", kernel_block_sizes=[KERNEL])
        with self.alloc:
            self.raw = torch.zeros(t0.buffer_size, dtype=torch.int8)
        gen = torch.Generator().manual_seed(seed)
        self.raw.copy_(torch.randint(-128, 128, self.raw.shape, dtype=torch.int8, generator=gen))
        self.views = {}
        for p, r in zip(t0.placements, t0.spec.regions, strict=True):
            part = self.raw[p.offset : p.offset + r.nbytes]
            self.views[p.region] = part.view(torch.bfloat16).view(r.num_blocks, 2, KERNEL, 64)
        assert kernel_block_sizes(self.cfg, self.views) == [KERNEL]
        self.worker = RankWorker("load-errors", 0, deadline_ms=30_000)
        self.link = EngineLink(socket)
        self.attached = attach_shared(
            self.link,
            self.alloc,
            self.cfg,
            self.views,
            model="m",
            layout="LBHNC",
            backend="CPU_ATTN",
            prefix_caching=False,
            wait_s=30.0,
            on_release=self.worker.on_release,
        )
        (g,) = self.attached.translated.spec.groups
        assert (g.logical_block_size, g.kernel_block_size, g.ppl) == (BLOCK, KERNEL, 2)
        self.worker.pull = PullLink(self.attached.pool.peer_address)  # gRPC + WatchTransfers

    def close(self) -> None:
        self.worker.close()
        self.link.close()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("load-errors"),
        DaemonOptions("prefill", "dense:num_blocks=16", extra=DAEMON_EXTRA),
        DaemonOptions(
            "decode",
            "dense:num_blocks=16",
            extra=(*DAEMON_EXTRA, "--set", "transfer.cma_threads=1"),
        ),
    )
    yield ds
    ds.stop()


def _cancel_once_transferring(stub: scheduler_pb2_grpc.SchedulerStub, tid: str) -> None:
    stream = stub.WatchTransfers(scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid]))
    try:
        for msg in stream:
            if msg.status.state == scheduler_pb2.TRANSFER_STATE_TRANSFERRING:
                stub.CancelTransfer(scheduler_pb2.CancelTransferRequest(transfer_id=tid))
                return
            if msg.status.state in TERMINAL:
                return
    finally:
        stream.cancel()


def test_load_errors_of_a_failed_pull_are_vllm_block_ids_with_kernel_splitting(
    daemons: Daemons,
) -> None:
    prefill = SplitEngine(daemons["prefill"].engine_socket, 1)
    decode = SplitEngine(daemons["decode"].engine_socket, 2)
    holds = RankHolds([daemons["prefill"].engine_socket], ttl_ms=10_000)
    channel = grpc.insecure_channel(daemons["decode"].grpc)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    remote = list(range(1, NUM_BLOCKS))
    local = remote[::-1]  # vLLM's block IDs for this request on the decode engine
    tokens = len(remote) * BLOCK
    try:
        for attempt in range(6):
            rid = f"split-{attempt}"
            out = holds.hold(rid, blocks_to_hold(FA, [remote], tokens, [BLOCK]), tokens)
            assert out.ticket is not None, out.errors
            ticket = ticket_from_params(out.ticket.to_params())
            assert ticket is not None
            job, err = plan_pull(rid, ticket, [[LocalBlock(b, True) for b in local]], FA, tokens)
            assert err is None, err
            decode.worker.start([job])  # StartPull over gRPC, then followed on a thread
            tid = decode.worker.transfer_id(rid)
            _cancel_once_transferring(stub, tid)
            end = time.monotonic() + 60
            while rid not in decode.worker.finished(())[1]:
                assert time.monotonic() < end, f"{rid} never reported finished"
                time.sleep(0.02)
            errors = decode.worker.load_errors()
            st = stub.GetTransfer(scheduler_pb2.GetTransferRequest(transfer_id=tid)).status
            if st.state == scheduler_pb2.TRANSFER_STATE_DONE:
                assert errors == set()
                continue  # the copy won the race: try again
            assert st.state == scheduler_pb2.TRANSFER_STATE_CANCELLED, st.error.message
            if not st.invalid_local_block_ids.groups:
                continue  # cancelled before its READ was posted: nothing listed
            listed = [int(b) for b in st.invalid_local_block_ids.groups[0].ids]
            assert sorted(listed) == sorted(local)  # the proto's logical IDs, each once
            # The pull may have written any of the request's blocks: vLLM must be told exactly
            # those, as vLLM's block IDs (its scheduler looks them up in the request's table).
            beyond = sorted(b for b in errors if b >= NUM_BLOCKS)
            assert errors == set(local), (
                f"get_block_ids_with_load_errors gave {len(errors)} IDs for a request of"
                f" {len(local)} vLLM blocks; {len(beyond)} are past vLLM's {NUM_BLOCKS} blocks"
                f" (e.g. {beyond[:4]}), {len(set(local) - errors)} of the request's blocks are"
                f" missing (e.g. {sorted(set(local) - errors)[:4]}), and"
                f" {len((errors - set(local)) & set(range(NUM_BLOCKS)))} belong to no block of"
                " this request: kernel block IDs reported as vLLM block IDs"
            )
            return
        pytest.fail("every pull finished (or was cancelled unposted) before its cancel landed")
    finally:
        channel.close()
        holds.close()
        prefill.close()
        decode.close()
