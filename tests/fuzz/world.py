"""The daemons under fuzz and what the fuzz knows about them.

Three real daemons (``kvxferd serve`` processes, started by :mod:`kvxferd.scenario.daemons`
through ``tests.service.conftest.launch``): ``prefill`` (pattern-filled) and ``decode`` own a
dense pool of 64 blocks; ``att`` runs ``pool.mode = attached`` so that Engine.Attach, Session
and Detach do real work there (allocate, register, deregister) without touching the pair.

:class:`World` holds the domain values that let generated requests get past the first
validation: requests held on both owners (``fz-0`` ... ``fz-3``), the live addresses, the
agents' names, the compatibility digest and a real handshake payload (captured from the decode
daemon by a fake peer), and what the fuzz created (transfers, staging grants, attachments) so
that it can be undone before the final verified pull.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf.message import Message
from hypothesis import strategies as st

from kvxferd.layout.presets import preset
from kvxferd.nixl import AgentOptions, MemType, NixlAgent
from kvxferd.peers import PROTOCOL_VERSION, compat_digest
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.v1 import common_pb2, engine_pb2, peer_pb2, scheduler_pb2
from kvxferd.wire.codec import group_ids_to_proto, spec_from_proto, spec_to_proto
from tests.fuzz import protofuzz as pf
from tests.fuzz.harness import BAD_CODES, STATS, Caller, Outcome, Rpc, all_rpcs
from tests.service.conftest import Daemon, Daemons

PRESET = "dense:num_blocks=64"
HELD = {"fz-0": [1, 2, 3], "fz-1": [10, 11, 12, 13], "fz-2": [40, 3, 17, 9], "fz-3": [63]}
SMALL_PRESETS = (
    "dense:num_blocks=4,num_layers=2",
    "mla:num_blocks=4,num_layers=2",
    "hybrid:num_blocks=2,attention_layers=1,mamba_layers=1",
    "fp8:num_blocks=4,full_layers=1,sliding_layers=1",
)
FUZZ_AGENTS = (f"fuzz-agent-{os.getpid()}-0", f"fuzz-agent-{os.getpid()}-1")
# Peer calls after a handshake carry the session it returned (where the wire contract has
# one: HandshakeResponse.session) in this metadata key.
SESSION_KEY = "kvxferd-session"
FAKE_PEER = f"fuzz-peer-{os.getpid()}"
# Pulls from the fake peer: (remote logical IDs, local logical IDs).
FAKE_PULLS = (([1, 2], [60, 61]), ([40, 3, 17, 9, 22], [62, 63, 59, 57, 56]), ([7, 8, 9], [55]))
HAS_SESSIONS = "session" in peer_pb2.HandshakeResponse.DESCRIPTOR.fields_by_name
HOLD_EVERY_S = 0.5


def start(tmp: Path) -> Daemons:
    """Start the three daemons as ``tests.service.conftest.launch`` does (metrics on), with
    the fuzz's own ``KVXFERD_FUZZ_*`` variables removed from their environment: the daemon
    refuses ``KVXFERD_*`` variables that name no configuration key."""
    options = [
        DaemonOptions("prefill", PRESET, fill_seed=3),
        DaemonOptions("decode", PRESET),
        DaemonOptions("att", PRESET, extra=("--set", "pool.mode=attached")),
    ]
    options = [
        dataclasses.replace(o, extra=(*o.extra, "--metrics-listen", "127.0.0.1:0")) for o in options
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_FUZZ_")}
    daemons = DaemonSet(tmp, options)
    try:
        daemons.start(env)
        daemons.wait_ready()
    except BaseException:
        daemons.stop()
        raise
    return Daemons(daemons)


RPCS = {r.id: r for r in all_rpcs()}


def rpc(rpc_id: str) -> Rpc:
    return RPCS[rpc_id]


@dataclass
class World:
    SETTLE_S = 10.0

    daemons: dict[str, Daemon]
    caller: Caller = field(default_factory=Caller)
    spec: Any = None  # the pair's KvCacheSpec message
    digest: bytes = b""
    agents: dict[str, str] = field(default_factory=dict)
    payloads: list[peer_pb2.HandshakePayload] = field(default_factory=list)
    transfers: set[tuple[str, str]] = field(default_factory=set)  # (daemon, transfer_id)
    grants: set[tuple[str, str, str, int]] = field(default_factory=set)
    attachment_id: str = ""
    sessions: dict[str, list[str]] = field(default_factory=dict)  # target -> session tokens
    nixl: list[NixlAgent] = field(default_factory=list)
    logs: dict[str, Path] = field(default_factory=dict)
    fake_payload: peer_pb2.HandshakePayload | None = None
    daemon_set: DaemonSet | None = None
    _buffers: list[torch.Tensor] = field(default_factory=list)
    _held_at: float = 0.0

    # -- addresses ------------------------------------------------------------------------------

    def tcp(self, name: str) -> str:
        return self.daemons[name].grpc

    def unix(self, name: str) -> str:
        return f"unix:{self.daemons[name].engine_socket}"

    def targets(self, r: Rpc) -> list[tuple[str, str]]:
        """(daemon, gRPC target) pairs an RPC is sent to, the pair's first (more often)."""
        if r.service == "Engine":
            if r.name in ("Attach", "Session", "Detach"):
                return [("att", self.unix("att")), ("att", self.unix("att"))] + [
                    (n, self.unix(n)) for n in ("prefill", "decode")
                ]
            return [(n, self.unix(n)) for n in ("prefill", "decode", "prefill", "decode", "att")]
        return [(n, self.tcp(n)) for n in ("prefill", "decode", "prefill", "decode", "att")]

    def metadata(self, r: Rpc, target: str, pick: int) -> tuple[tuple[str, str], ...]:
        """Call metadata for ``r``: for Peer calls none, a made-up session, or a session a
        handshake with ``target`` returned (``pick`` chooses; real sessions most often)."""
        if r.service != "Peer" or r.name == "Handshake" or not HAS_SESSIONS:
            return ()
        real = [((SESSION_KEY, t),) for t in self.sessions.get(target, [])[-3:]]
        options: list[tuple[tuple[str, str], ...]] = [(), ((SESSION_KEY, "00" * 16),)]
        options += real * 3
        return options[pick % len(options)]

    def handshake(self, target: str, payload: peer_pb2.HandshakePayload) -> Outcome:
        req = peer_pb2.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, compat_digest=self.digest, payload=_ser(payload)
        )
        out = self.setup_call("Peer.Handshake", target, req)
        self.keep_session(target, out)
        return out

    def keep_session(self, target: str, out: Outcome) -> None:
        if out.code != "OK" or not HAS_SESSIONS:
            return
        token = getattr(peer_pb2.HandshakeResponse.FromString(out.body), "session", b"")
        known = self.sessions.setdefault(target, [])
        if token and token.hex() not in known:
            known.append(token.hex())

    def dead(self) -> list[str]:
        return [n for n, d in self.daemons.items() if not d.alive()]  # type: ignore[operator]

    # -- plain calls used to set the scene (checked, not counted) ------------------------------

    def setup_call(
        self, rpc_id: str, target: str, msg: Message, timeout_s: float = 10.0
    ) -> Outcome:
        out = self.caller.call(RPCS[rpc_id], target, msg.SerializeToString(), timeout_s)
        if out.code in BAD_CODES:
            STATS.fail(rpc_id, "setup", target, out.code, out.details, msg.SerializeToString())
        return out

    def describe(self, name: str) -> engine_pb2.PoolInfo:
        out = self.setup_call("Engine.Describe", self.unix(name), engine_pb2.DescribeRequest())
        assert out.code == "OK", out
        return engine_pb2.DescribeResponse.FromString(out.body).pool

    def learn(self) -> None:
        for name in self.daemons:
            self.agents[name] = self.describe(name).nixl_agent_name
        pool = self.describe("prefill")
        self.spec = pool.spec
        self.digest = bytes.fromhex(compat_digest(spec_from_proto(pool.spec)))
        real = peer_pb2.HandshakePayload.FromString(capture_handshake(self, "decode"))
        for i, name in enumerate(FUZZ_AGENTS):
            # The fuzz's own NIXL agents, so that its handshakes carry metadata that loads
            # and are accepted (and the calls after them get past the session check). A
            # payload claiming a victim's agent name is issue 11 item 3's own test: it would
            # take the pair's link away mid-fuzz.
            mine = peer_pb2.HandshakePayload()
            mine.CopyFrom(real)
            mine.nixl_agent_name = name
            mine.nixl_agent_metadata = self._agent_metadata(name)
            mine.daemon_id = name
            mine.instance_id = f"{i:032x}"
            mine.peer_address = "127.0.0.1:1"
            self.payloads.append(mine)
        for name in ("prefill", "decode"):
            for payload in self.payloads:
                out = self.handshake(self.tcp(name), payload)
                assert out.code == "OK", (name, out.code, out.details)
                if name == "prefill":
                    prefill = peer_pb2.HandshakePayload.FromString(
                        peer_pb2.HandshakeResponse.FromString(out.body).payload
                    )
        # The malicious owner (tests/fuzz/fakepeer.py): the prefill daemon's spec,
        # registrations and ring under an identity of its own.
        fake = peer_pb2.HandshakePayload()
        fake.CopyFrom(prefill)
        fake.nixl_agent_name = FAKE_PEER
        fake.nixl_agent_metadata = self._agent_metadata(FAKE_PEER)
        fake.daemon_id = FAKE_PEER
        fake.instance_id = "f" * 32
        self.fake_payload = fake

    def _agent_metadata(self, name: str) -> bytes:
        agent = NixlAgent(name, options=AgentOptions(idle_poll_s=0.005))
        agent.start()
        self.nixl.append(agent)
        buf = torch.zeros(1 << 16, dtype=torch.uint8)
        self._buffers.append(buf)
        agent.register(np.array([[buf.data_ptr(), buf.numel(), 0]], dtype=np.int64), MemType.DRAM)
        return agent.metadata()

    def stop(self) -> list[str]:
        """SIGTERM the daemons; what did not end with status 0 in the grace period."""
        if self.daemon_set is None:
            return []
        self.daemon_set.stop()
        return self.daemon_set.stop_problems()

    def close(self) -> None:
        self.caller.close()
        for agent in self.nixl:
            agent.close()
        self.nixl.clear()
        if self.daemon_set is not None:
            self.daemon_set.stop()  # a no-op when test_zz_... stopped them already

    def hold_all(self, force: bool = False) -> None:
        """Keep ``fz-*`` held on both owners (the fuzz releases and confirms them)."""
        now = time.monotonic()
        if not force and now - self._held_at < HOLD_EVERY_S:
            return
        self._held_at = now
        for name in ("prefill", "decode"):
            for rid, ids in HELD.items():
                self.setup_call(
                    "Engine.Hold",
                    self.unix(name),
                    engine_pb2.HoldRequest(
                        request_id=rid, block_ids=group_ids_to_proto([ids]), ttl_ms=60_000
                    ),
                )

    def ensure_attached(self) -> None:
        pool = self.describe("att")
        if pool.state == engine_pb2.REGISTRATION_STATE_REGISTERED and pool.attachment_id:
            self.attachment_id = pool.attachment_id
            return
        out = self.setup_call(
            "Engine.Attach",
            self.unix("att"),
            engine_pb2.AttachRequest(
                preset=SMALL_PRESETS[0], memory_mode=engine_pb2.MEMORY_MODE_OWNED
            ),
        )
        if out.code == "OK":
            self.attachment_id = engine_pb2.AttachResponse.FromString(out.body).pool.attachment_id

    def detach_att(self) -> None:
        self.setup_call("Engine.Detach", self.unix("att"), engine_pb2.DetachRequest(force=True))

    # -- before / after each fuzzed call --------------------------------------------------------

    def before(self, r: Rpc) -> None:
        if r.service in ("Peer", "Scheduler") or r.name in ("Hold", "WatchReleases"):
            self.hold_all()
        if r.name in ("Session", "Detach"):
            self.ensure_attached()

    def after(self, r: Rpc, daemon: str, target: str, body: bytes, out: Outcome) -> None:
        if out.code != "OK":
            return
        if r.id == "Peer.Handshake":
            self.keep_session(target, out)
        elif r.id == "Scheduler.StartPull":
            status = scheduler_pb2.StartPullResponse.FromString(out.body).status
            self.transfers.add((daemon, status.transfer_id))
        elif r.id == "Peer.Gather":
            req = peer_pb2.GatherRequest.FromString(body)
            slot = peer_pb2.GatherResponse.FromString(out.body).slot
            # A well-behaved reader: read the slot, give it back.
            self.setup_call(
                "Peer.ReleaseStaging",
                target,
                peer_pb2.ReleaseStagingRequest(
                    request_id=req.request_id, reader_id=req.reader_id, slots=[slot]
                ),
            )
            self.grants.add((target, req.request_id, req.reader_id, slot))
        elif r.id == "Engine.Attach" and daemon == "att":
            self.detach_att()

    # -- undo what the fuzz started, before the verified pull -----------------------------------

    def settle(self) -> list[str]:
        """Cancel every transfer the fuzz started, give back staging grants; returns the IDs
        of transfers that did not reach a terminal state."""
        stuck = []
        cancelled: dict[tuple[str, str], str] = {}
        for daemon, tid in sorted(self.transfers):
            out = self.setup_call(
                "Scheduler.CancelTransfer",
                self.tcp(daemon),
                scheduler_pb2.CancelTransferRequest(transfer_id=tid),
                timeout_s=3.0,
            )
            cancelled[daemon, tid] = out.code
        deadline = time.monotonic() + self.SETTLE_S
        for daemon, tid in sorted(self.transfers):
            while True:
                out = self.setup_call(
                    "Scheduler.GetTransfer",
                    self.tcp(daemon),
                    scheduler_pb2.GetTransferRequest(transfer_id=tid),
                )
                if out.code != "OK":
                    break  # forgotten
                status = scheduler_pb2.GetTransferResponse.FromString(out.body).status
                if status.state >= scheduler_pb2.TRANSFER_STATE_DONE:
                    break
                if time.monotonic() > deadline:
                    state = scheduler_pb2.TransferState.Name(status.state)
                    why = f"CancelTransfer {cancelled[daemon, tid]}"
                    stuck.append(f"{daemon}:{tid} ({state}; {why})")
                    break
                time.sleep(0.05)
        for target, rid, reader, slot in sorted(self.grants):
            self.setup_call(
                "Peer.ReleaseStaging",
                target,
                peer_pb2.ReleaseStagingRequest(request_id=rid, reader_id=reader, slots=[slot]),
            )
        return stuck

    # -- strategies -------------------------------------------------------------------------------

    def hints(self) -> dict[str, st.SearchStrategy[Any]]:
        ids = st.one_of(
            st.lists(st.integers(-2, 66), max_size=8),
            st.lists(st.integers(0, 63), unique=True, max_size=16),
            st.sampled_from(list(HELD.values())),
        )
        block_ids = ids.map(lambda v: common_pb2.BlockIds(ids=v))
        groups = st.one_of(
            st.lists(block_ids, min_size=1, max_size=1),
            st.lists(block_ids, max_size=3),
        )
        rid = st.sampled_from([*HELD, "", "never-held", "a\nb\x00c"])
        reader = st.sampled_from(["r-0", "r-1", "", *self.agents.values()])
        pport = self.tcp("prefill").rsplit(":", 1)[1]
        address = st.sampled_from(
            [
                self.tcp("prefill"),
                self.tcp("decode"),
                self.tcp("att"),
                f"localhost:{pport}",
                "127.0.0.1:1",
                "127.0.0.1:99999",
                "[::1]:1",
                "",
                "unix:/nonexistent.sock",
                "zz.invalid:1",
            ]
        )
        transfer = st.one_of(
            st.sampled_from(["", "t-0", "t-1"]),
            st.builds(self._some_transfer, st.integers(0, 10_000)),
        )
        small_ms = st.integers(1, 5000)
        names = st.sampled_from(list(self.agents.values()) + list(FUZZ_AGENTS))
        specs = [spec_to_proto(preset(p)) for p in SMALL_PRESETS]
        shm = st.sampled_from(
            [
                "",
                "/",
                "/kvxferd-nonexistent",
                "../../../etc/passwd",
                "/dev/shm/../../etc",
                "/x" * 200,
            ]
        )
        return {
            "kvxferd.v1.BlockIds.ids": ids,
            "kvxferd.v1.GroupBlockIds.groups": groups,
            "kvxferd.v1.ChecksumRequest.block_ids": st.lists(st.integers(-2, 66), max_size=8),
            "kvxferd.v1.ChecksumRequest.group_index": st.integers(0, 2),
            "request_id": rid,
            "request_ids": st.lists(rid, max_size=4),
            "renew_request_ids": st.lists(rid, max_size=4),
            "reader_id": reader,
            "daemon_id": reader,
            "peer_address": address,
            "transfer_id": transfer,
            "transfer_ids": st.lists(transfer, max_size=3),
            "extend_ms": small_ms,
            "renew_ms": small_ms,
            "ttl_ms": small_ms,
            "deadline_ms": small_ms,
            "expected_readers": st.integers(0, 3),
            "slots": st.lists(st.integers(0, 9), max_size=4),
            "release_slots": st.lists(st.integers(0, 9), max_size=4),
            "attachment_id": st.builds(lambda _: self.attachment_id, st.none()),
            "nixl_agent_name": names,
            "kvxferd.v1.HandshakeRequest.protocol_version": st.just(1),
            "kvxferd.v1.HandshakeRequest.compat_digest": st.just(self.digest),
            "kvxferd.v1.HandshakeRequest.payload": st.one_of(
                pf.mutated(lambda: self.payloads).map(_ser),
                pf.messages(peer_pb2.HandshakePayload.DESCRIPTOR).map(_ser),
            ),
            "kvxferd.v1.AttachRequest.preset": st.one_of(
                st.sampled_from(
                    [
                        *SMALL_PRESETS,
                        "dense",
                        "dense:num_blocks=0",
                        "dense:num_blocks=-1",
                        "dense:num_blocks=1000000000000",
                        "dense:layout=XYZ",
                        "dense:num_blocks",
                        "dense:num_blocks=4,memory=VRAM",
                        "dense:dtype=int4",
                        "nope",
                    ]
                ),
                st.builds(
                    lambda n: f"dense:num_blocks={n},num_layers=1", pf.ints(pf.FD.TYPE_INT64)
                ),
            ),
            "kvxferd.v1.AttachRequest.spec": pf.mutated(lambda: specs),
            "kvxferd.v1.AttachRequest.memory_mode": st.sampled_from([1, 2]),
            "shm_name": shm,
        }

    def _some_transfer(self, i: int) -> str:
        known = sorted(self.transfers)
        return known[i % len(known)][1] if known else "t-none"

    def bases(self, r: Rpc) -> Callable[[], Sequence[Message]]:
        """Valid requests of ``r`` (called at draw time: they follow the world's state)."""
        g = group_ids_to_proto

        def make() -> Sequence[Message]:
            p, tid = self.tcp("prefill"), self._some_transfer(0)
            table: dict[str, list[Message]] = {
                "Peer.Handshake": [
                    peer_pb2.HandshakeRequest(
                        protocol_version=PROTOCOL_VERSION,
                        compat_digest=self.digest,
                        payload=x.SerializeToString(),
                    )
                    for x in self.payloads
                ],
                "Peer.ConfirmLease": [
                    peer_pb2.ConfirmLeaseRequest(request_id="fz-0", reader_id="r-0", extend_ms=1000)
                ],
                "Peer.ExtendLease": [
                    peer_pb2.ExtendLeaseRequest(request_id="fz-1", reader_id="r-0", extend_ms=1000)
                ],
                "Peer.ReleaseLease": [
                    peer_pb2.ReleaseLeaseRequest(request_id="fz-2", reader_id="r-1", reason=1)
                ],
                "Peer.DeclineLease": [
                    peer_pb2.DeclineLeaseRequest(request_id="fz-3", reader_id="r-2")
                ],
                "Peer.Heartbeat": [
                    peer_pb2.HeartbeatRequest(
                        daemon_id="r-0",
                        instance_id="i-0",
                        registration_generation=1,
                        renew_request_ids=["fz-0", "fz-1"],
                        renew_ms=1000,
                    )
                ],
                "Peer.Gather": [
                    peer_pb2.GatherRequest(
                        request_id="fz-0", reader_id="r-0", kernel_block_ids=g([[1, 2]])
                    )
                ],
                "Peer.Stage": [
                    peer_pb2.StageRequest(
                        open=peer_pb2.StageOpen(
                            request_id="fz-0",
                            reader_id="r-0",
                            kernel_block_ids=g([[1, 2]]),
                            chunk_bytes=1 << 20,
                            chunks=1,
                            credits=1,
                        )
                    ),
                    peer_pb2.StageRequest(read_slots=[0]),
                ],
                "Peer.ReleaseStaging": [
                    peer_pb2.ReleaseStagingRequest(request_id="fz-0", reader_id="r-0", slots=[0])
                ],
                "Peer.Push": [
                    peer_pb2.PushRequest(
                        request_id="fz-0",
                        remote_block_ids=g([[1, 2]]),
                        local_block_ids=g([[50, 51]]),
                        notif_ticket=7,
                        write_timeout_ms=1000,
                    )
                ],
                "Scheduler.StartPull": [
                    scheduler_pb2.StartPullRequest(
                        request_id=rid,
                        peer_address=p,
                        remote_block_ids=g([ids]),
                        local_block_ids=g([[50 + i for i in range(len(ids))]]),
                        deadline_ms=3000,
                    )
                    for rid, ids in HELD.items()
                ],
                "Scheduler.WatchTransfers": [
                    scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid]),
                    scheduler_pb2.WatchTransfersRequest(),
                ],
                "Scheduler.GetTransfer": [scheduler_pb2.GetTransferRequest(transfer_id=tid)],
                "Scheduler.CancelTransfer": [scheduler_pb2.CancelTransferRequest(transfer_id=tid)],
                "Scheduler.DeclinePull": [
                    scheduler_pb2.DeclinePullRequest(request_id="fz-3", peer_address=p),
                    scheduler_pb2.DeclinePullRequest(
                        request_id="never-held", peer_address=p, deadline_ms=3000
                    ),
                ],
                "Scheduler.ListPeers": [scheduler_pb2.ListPeersRequest()],
                "Scheduler.Checksum": [
                    scheduler_pb2.ChecksumRequest(group_index=0, block_ids=[0, 1, 63]),
                    scheduler_pb2.ChecksumRequest(block_ids=[5], kernel_block_ids=True),
                ],
                "Engine.Attach": [
                    engine_pb2.AttachRequest(preset=SMALL_PRESETS[0], memory_mode=1),
                    engine_pb2.AttachRequest(spec=self.spec, memory_mode=1),
                    engine_pb2.AttachRequest(
                        preset=SMALL_PRESETS[0],
                        memory_mode=2,
                        imports=[engine_pb2.MemoryHandle(region_name="layer.0", shm_name="/x")],
                    ),
                ],
                "Engine.Describe": [engine_pb2.DescribeRequest()],
                "Engine.Hold": [
                    engine_pb2.HoldRequest(
                        request_id="fz-h", block_ids=g([[7, 8]]), expected_readers=2, ttl_ms=2000
                    )
                ],
                "Engine.WatchReleases": [engine_pb2.WatchReleasesRequest(request_ids=["fz-0"])],
                "Engine.Detach": [
                    engine_pb2.DetachRequest(force=True, attachment_id=self.attachment_id)
                ],
                "Engine.Session": [engine_pb2.SessionRequest(attachment_id=self.attachment_id)],
            }
            return table[r.id]

        return make

    def message_strategy(self, r: Rpc) -> st.SearchStrategy[bytes]:
        """Two parts mutations of valid requests (they get deep), one part generated from the
        descriptor alone (with domain hints mixed in)."""
        hints = self.hints()
        deep: st.SearchStrategy[Message] = pf.mutated(self.bases(r), hints)
        if r.id == "Peer.Handshake":
            # The payload is opaque bytes in the envelope: mutate the payload itself.
            deep = st.builds(
                lambda payload, version, digest: peer_pb2.HandshakeRequest(
                    protocol_version=version, compat_digest=digest, payload=_ser(payload)
                ),
                pf.mutated(lambda: self.payloads, hints),
                st.one_of(st.just(1), st.just(1), pf.ints(pf.FD.TYPE_UINT32)),
                st.one_of(st.just(self.digest), st.just(self.digest), pf.blobs()),
            )
        return st.one_of(deep.map(_ser), deep.map(_ser), pf.messages(r.input, hints).map(_ser))

    def fake_answers(self, remote: list[int]) -> dict[str, list[Message]]:
        """Valid answers of a fake owner holding ``remote`` for the decode daemon."""
        assert self.fake_payload is not None
        hello = peer_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            compat_digest=self.digest,
            payload=_ser(self.fake_payload),
        )
        if HAS_SESSIONS:
            hello.session = bytes(range(16))
        lease = peer_pb2.Lease(
            request_id="mp",
            state=peer_pb2.LEASE_STATE_ACTIVE,
            expires_unix_ns=time.time_ns() + 10**10,
            remaining_ms=10_000,
            block_ids=group_ids_to_proto([remote]),
            readers_expected=1,
            readers_confirmed=1,
            registration_generation=self.fake_payload.registration_generation,
        )
        confirm = peer_pb2.ConfirmLeaseResponse(lease=lease)
        for name, value in (("ticket", 7), ("instance_id", self.fake_payload.instance_id)):
            if name in confirm.DESCRIPTOR.fields_by_name:
                setattr(confirm, name, value)
        beat = peer_pb2.HeartbeatResponse(
            instance_id=self.fake_payload.instance_id,
            registration_generation=self.fake_payload.registration_generation,
            server_time_unix_ns=time.time_ns(),
        )
        ring = self.fake_payload.staging
        return {
            "Handshake": [hello],
            "ConfirmLease": [confirm],
            "ExtendLease": [peer_pb2.ExtendLeaseResponse(lease=lease)],
            "ReleaseLease": [peer_pb2.ReleaseLeaseResponse(lease=lease)],
            "Heartbeat": [beat],
            "Gather": [
                peer_pb2.GatherResponse(slot=1, offset=ring.chunk_bytes, nbytes=4096, gather_us=5)
            ],
            "ReleaseStaging": [peer_pb2.ReleaseStagingResponse(released=1)],
        }

    def fake_peer_strategy(self) -> st.SearchStrategy[tuple[int, Any]]:
        from tests.fuzz.fakepeer import scripts

        hints = self.hints()
        return st.one_of(
            *(
                st.tuples(
                    st.just(i), scripts(lambda remote=remote: self.fake_answers(remote), hints)
                )
                for i, (remote, _) in enumerate(FAKE_PULLS)
            )
        )

    def log_problems(self) -> list[str]:
        """Lines of the daemons' logs that say something went wrong inside: error level,
        tracebacks, unretrieved task exceptions."""
        out = []
        for name, path in self.logs.items():
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                low = line.lower()
                if (
                    '"level": "error"' in low
                    or '"level": "critical"' in low
                    or "traceback" in low
                    or "exception was never retrieved" in low
                    or "kvxferd bug" in low
                ):
                    out.append(f"{name}: {line[:600]}")
        return out

    def raw_strategy(self, r: Rpc) -> st.SearchStrategy[bytes]:
        make = self.bases(r)
        return pf.raw_bodies(r.input, lambda: [m.SerializeToString() for m in make()])


def _ser(m: Message) -> bytes:
    return m.SerializeToString()


def capture_handshake(world: World, daemon: str) -> bytes:
    """The daemon's real handshake payload: a fake peer records the Handshake it receives
    when the daemon is asked to pull from it, and refuses it."""
    got: list[bytes] = []

    def handshake(request: bytes, context: grpc.ServicerContext) -> bytes:
        got.append(request)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "fuzz harness: fake peer")
        raise AssertionError("unreachable")  # pragma: no cover

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "kvxferd.v1.Peer",
                {
                    "Handshake": grpc.unary_unary_rpc_method_handler(
                        handshake, request_deserializer=None, response_serializer=None
                    )
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        world.setup_call(
            "Scheduler.StartPull",
            world.tcp(daemon),
            scheduler_pb2.StartPullRequest(
                request_id="capture",
                peer_address=f"127.0.0.1:{port}",
                remote_block_ids=group_ids_to_proto([[1]]),
                local_block_ids=group_ids_to_proto([[1]]),
            ),
        )
    finally:
        server.stop(None)
    assert got, f"the {daemon} daemon did not handshake with the fake peer"
    return peer_pb2.HandshakeRequest.FromString(got[0]).payload
