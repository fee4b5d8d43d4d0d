"""Transport truth through real daemons (CPU): after the handshake the decode daemon knows what
serves READs from the prefill daemon (a timed probe READ), shows it in ListPeers and in the
handshake log line, and says why the pull was not KERNEL (host memory)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import pytest

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.service.conftest import Daemons, launch
from tests.service.test_service_pull import Client


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("truth"),
        DaemonOptions("prefill", "dense:num_blocks=32", fill_seed=3),
        DaemonOptions("decode", "dense:num_blocks=32"),
    )
    yield ds
    ds.stop()


def test_list_peers_and_the_handshake_log_say_what_serves_reads(
    daemons: Daemons,
) -> None:
    ds = daemons
    prefill, decode = ds["prefill"], ds["decode"]

    async def go() -> tuple[scheduler_pb2.TransferStatus, scheduler_pb2.ListPeersResponse]:
        c = Client(prefill, decode)
        held = await c.hold("truth-1", [1, 2, 3])
        st = await c.pull(held, [4, 5, 6])
        st = await c.wait(st.transfer_id)
        return st, await c.decode.ListPeers(scheduler_pb2.ListPeersRequest())

    st, peers = asyncio.run(go())
    assert st.state == scheduler_pb2.TRANSFER_STATE_DONE
    # same-host host memory: auto reads it with CMA (docs/strategies.md); the probe still ran
    assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_CMA, st.strategy_reason
    (p,) = peers.peers
    assert p.same_host
    assert p.read_transport in ("cma", "tcp")  # host memory on one host
    assert p.read_probe_gbps > 0
    assert (
        "probe READ" in p.read_transport_detail
        and "DRAM -> DRAM, same host" in p.read_transport_detail
    )
    log = ds.set["decode"].log_path.read_text()
    lines = [json.loads(x) for x in log.splitlines() if '"handshake done"' in x]
    assert lines and lines[-1]["read_transport"] == p.read_transport and lines[-1]["same_host"]
    body = urllib.request.urlopen(f"http://{decode.metrics}/metrics", timeout=5).read().decode()
    want = f'kvxferd_peer_read_transport{{peer="{prefill.grpc}",transport="{p.read_transport}"}}'
    assert want in body
