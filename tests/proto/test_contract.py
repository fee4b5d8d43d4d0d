"""The wire contract ``kvxferd.v1``: generated code imports, key messages round-trip, the
handshake envelope is frozen, and the proto enums stay in step with the Python values they
mirror (kvxferd.layout, kvxferd.errors)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from importlib import metadata
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from kvxferd import errors, peers
from kvxferd.layout import dtypes, spec
from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    spec_pb2,
)

ROOT = Path(__file__).resolve().parents[2]
FILES = (spec_pb2, common_pb2, peer_pb2, scheduler_pb2, engine_pb2)


def _enum_values(enum: _descriptor.EnumDescriptor) -> set[str]:
    return {v.name for v in enum.values if v.number != 0}


def _all_enums() -> Iterator[_descriptor.EnumDescriptor]:
    def nested(msg: _descriptor.Descriptor) -> Iterator[_descriptor.EnumDescriptor]:
        yield from msg.enum_types
        for sub in msg.nested_types:
            yield from nested(sub)

    for mod in FILES:
        yield from mod.DESCRIPTOR.enum_types_by_name.values()
        for msg in mod.DESCRIPTOR.message_types_by_name.values():
            yield from nested(msg)


def _sample_spec() -> spec_pb2.KvCacheSpec:
    return spec_pb2.KvCacheSpec(
        model="nemotron-h-tiny",
        groups=[
            spec_pb2.KvGroup(
                name="full_attention",
                kind=spec_pb2.GROUP_KIND_FULL_ATTENTION,
                logical_block_size=32,
                kernel_block_size=16,
            ),
            spec_pb2.KvGroup(
                name="mamba",
                kind=spec_pb2.GROUP_KIND_MAMBA,
                logical_block_size=32,
                kernel_block_size=32,
            ),
        ],
        regions=[
            spec_pb2.KvRegion(
                name="layers.0.attn",
                group_index=0,
                dtype=spec_pb2.KV_DTYPE_FP8_E4M3,
                layout=spec_pb2.LAYOUT_HND,
                shape=[1024, 2, 16, 8, 128],
                memory=spec_pb2.MEMORY_TYPE_VRAM,
            ),
            spec_pb2.KvRegion(
                name="layers.1.ssm",
                group_index=1,
                dtype=spec_pb2.KV_DTYPE_BF16,
                layout=spec_pb2.LAYOUT_STATE,
                shape=[64, 4, 2048],
                memory=spec_pb2.MEMORY_TYPE_VRAM,
                block_stride=1 << 20,
            ),
        ],
    )


def _group_ids(*groups: list[int]) -> common_pb2.GroupBlockIds:
    return common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=g) for g in groups])


# --- the handshake envelope ----------------------------------------------------------------


@pytest.mark.parametrize("message", [peer_pb2.HandshakeRequest, peer_pb2.HandshakeResponse])
def test_handshake_envelope_is_version_digest_then_opaque_payload(
    message: type[peer_pb2.HandshakeRequest] | type[peer_pb2.HandshakeResponse],
) -> None:
    fields = {f.name: f for f in message.DESCRIPTOR.fields}
    envelope = {"protocol_version", "compat_digest", "payload"}
    # The response also carries the caller's session (field 4), outside the fixed envelope.
    extra = {"session"} if message is peer_pb2.HandshakeResponse else set()
    assert set(fields) == envelope | extra
    if extra:
        assert (fields["session"].number, fields["session"].type) == (4, FieldDescriptor.TYPE_BYTES)
    assert (fields["protocol_version"].number, fields["protocol_version"].type) == (
        1,
        FieldDescriptor.TYPE_UINT32,
    )
    assert (fields["compat_digest"].number, fields["compat_digest"].type) == (
        2,
        FieldDescriptor.TYPE_BYTES,
    )
    # The rest is bytes, not a message: it is decoded only after 1 and 2 are checked.
    assert (fields["payload"].number, fields["payload"].type) == (3, FieldDescriptor.TYPE_BYTES)


def test_envelope_reads_without_decoding_a_payload_of_another_version() -> None:
    # A future peer: unknown version, a payload that is not a v1 HandshakePayload, and an extra
    # envelope field. The envelope still parses; the payload stays opaque bytes.
    garbage = b"\xff\xfe not a protobuf \x00"
    envelope = peer_pb2.HandshakeRequest(
        protocol_version=7, compat_digest=b"\x01" * 32, payload=garbage
    )
    wire = envelope.SerializeToString() + bytes([0x20, 0x05])  # field 4 = 5, unknown to v1
    got = peer_pb2.HandshakeRequest.FromString(wire)
    assert got.protocol_version == 7
    assert got.compat_digest == b"\x01" * 32
    assert got.payload == garbage
    with pytest.raises(DecodeError):
        peer_pb2.HandshakePayload.FromString(got.payload)


def test_handshake_payload_round_trips_through_the_envelope() -> None:
    payload = peer_pb2.HandshakePayload(
        spec=_sample_spec(),
        registrations=[
            spec_pb2.RegionRegistration(
                region_name="layers.0.attn",
                base_address=0x7F00_0000_0000,
                device_id=3,
                nbytes=1024 * 2 * 16 * 8 * 128,
            ),
            spec_pb2.RegionRegistration(
                region_name="layers.1.ssm",
                base_address=0x7F10_0000_0000,
                device_id=3,
                nbytes=63 * (1 << 20) + 4 * 2048 * 2,
            ),
        ],
        nixl_agent_name="kvxferd-prefill-0-3",
        nixl_agent_metadata=bytes(range(256)) * 3,
        registration_generation=2,
        tp_rank=3,
        tp_size=4,
        prefix_caching=True,
        daemon_id="prefill-0-rank-3",
        instance_id="4f1c0e9a",
        peer_address="10.0.0.7:7070",
    )
    request = peer_pb2.HandshakeRequest(
        protocol_version=peer_pb2.PROTOCOL_VERSION_V1,
        compat_digest=b"\xab" * 32,
        payload=payload.SerializeToString(deterministic=True),
    )
    got = peer_pb2.HandshakeRequest.FromString(request.SerializeToString())
    assert got == request
    assert peer_pb2.HandshakePayload.FromString(got.payload) == payload


def test_protocol_version_history_lists_every_version() -> None:
    text = (ROOT / "proto/kvxferd/v1/peer.proto").read_text(encoding="utf-8")
    block = text.split("PROTOCOL_VERSION history", 1)[1].split("\n\n", 1)[0]
    listed = sorted(int(n) for n in re.findall(r"^//\s+(\d+):", block, re.MULTILINE))
    known = sorted(v.number for v in peer_pb2.ProtocolVersion.DESCRIPTOR.values if v.number)
    assert listed == known == list(range(1, len(known) + 1))
    # The constant the daemon sends is the newest version the wire contract knows.
    assert max(known) == peers.PROTOCOL_VERSION


# --- key messages ----------------------------------------------------------------------------


def test_block_ids_are_packed_and_signed() -> None:
    ids = common_pb2.BlockIds(ids=[1, 2, 3])
    # field 1, wire type 2 (length-delimited): one packed run, not three tagged varints.
    assert ids.SerializeToString() == b"\x0a\x03\x01\x02\x03"
    neg = common_pb2.BlockIds(ids=[-1, 2**40])
    assert list(common_pb2.BlockIds.FromString(neg.SerializeToString()).ids) == [-1, 2**40]


def test_start_pull_and_transfer_status_round_trip() -> None:
    req = scheduler_pb2.StartPullRequest(
        transfer_id="t-1",
        request_id="req-42",
        peer_address="10.0.0.7:7070",
        remote_block_ids=_group_ids([5, 6], [2]),
        local_block_ids=_group_ids([9], [4]),
        deadline_ms=5000,
        options=scheduler_pb2.PullOptions(skip_notify=True),
    )
    assert scheduler_pb2.StartPullRequest.FromString(req.SerializeToString()) == req

    status = scheduler_pb2.TransferStatus(
        transfer_id="t-1",
        request_id="req-42",
        peer_address="10.0.0.7:7070",
        state=scheduler_pb2.TRANSFER_STATE_FAILED,
        nbytes=1 << 30,
        descriptors_before_coalescing=16384,
        descriptors_after_coalescing=3,
        strategy=scheduler_pb2.TRANSFER_STRATEGY_DIRECT,
        error=common_pb2.ErrorDetail(
            kind=common_pb2.ERROR_KIND_PEER_UNAVAILABLE,
            message="peer 10.0.0.7:7070 disconnected mid-transfer",
            fix="the prefill daemon restarted; retry the request",
        ),
        invalid_local_block_ids=_group_ids([9], []),
        created_unix_ns=1_700_000_000_000_000_000,
        started_unix_ns=1_700_000_000_001_000_000,
        finished_unix_ns=1_700_000_000_002_000_000,
        revision=4,
    )
    got = scheduler_pb2.TransferStatus.FromString(status.SerializeToString())
    assert got == status
    assert got.HasField("error")
    assert list(got.invalid_local_block_ids.groups[1].ids) == []


def test_hold_response_feeds_start_pull_by_field_name() -> None:
    hold = engine_pb2.HoldResponse(
        peer_address="10.0.0.7:7070", request_id="req-42", remote_block_ids=_group_ids([5, 6])
    )
    start = scheduler_pb2.StartPullRequest()
    for name in ("peer_address", "request_id", "remote_block_ids"):
        assert name in scheduler_pb2.StartPullRequest.DESCRIPTOR.fields_by_name
    start.peer_address = hold.peer_address
    start.request_id = hold.request_id
    start.remote_block_ids.CopyFrom(hold.remote_block_ids)
    assert list(start.remote_block_ids.groups[0].ids) == [5, 6]


def test_incompatible_peer_detail_round_trips() -> None:
    detail = common_pb2.ErrorDetail(
        kind=common_pb2.ERROR_KIND_INCOMPATIBLE_PEER,
        message="handshake refused, 2 mismatch(es)",
        mismatches=[
            common_pb2.Mismatch(what="regions[3].dtype", local="bf16", remote="fp8_e4m3", fix="x"),
            common_pb2.Mismatch(what="ppl", local="34", remote="66", fix="disable prefix caching"),
        ],
    )
    got = common_pb2.ErrorDetail.FromString(detail.SerializeToString())
    assert [m.what for m in got.mismatches] == ["regions[3].dtype", "ppl"]


def test_attach_oneof_and_memory_handle() -> None:
    req = engine_pb2.AttachRequest(
        preset="llama3-8b",
        memory_mode=engine_pb2.MEMORY_MODE_IMPORTED,
        imports=[engine_pb2.MemoryHandle(region_name="l0", cuda_ipc_handle=b"\x00" * 64)],
    )
    assert req.WhichOneof("source") == "preset"
    req.spec.CopyFrom(_sample_spec())
    assert req.WhichOneof("source") == "spec"
    got = engine_pb2.AttachRequest.FromString(req.SerializeToString())
    assert got.imports[0].WhichOneof("handle") == "cuda_ipc_handle"


# --- conventions every file keeps ------------------------------------------------------------


def test_every_enum_starts_with_unspecified_zero() -> None:
    enums = list(_all_enums())
    assert len(enums) >= 14  # every enum of every file (Priority was removed)
    for enum in enums:
        zero = enum.values_by_number[0]
        assert zero.name.endswith("_UNSPECIFIED"), enum.full_name


def test_everything_is_in_package_kvxferd_v1() -> None:
    for mod in FILES:
        assert mod.DESCRIPTOR.package == "kvxferd.v1"
        source = (ROOT / "proto" / mod.DESCRIPTOR.name).read_text(encoding="utf-8")
        assert 'syntax = "proto3";' in source


def test_services_and_streaming_shape() -> None:
    expected = {
        peer_pb2: (
            "Peer",
            {
                "Handshake",
                "ConfirmLease",
                "ExtendLease",
                "ReleaseLease",
                "DeclineLease",
                "Heartbeat",
                "Gather",
                "ReleaseStaging",
                "Push",
                "Stage",
            },
            {"Stage"},
        ),
        scheduler_pb2: (
            "Scheduler",
            {
                "StartPull",
                "WatchTransfers",
                "GetTransfer",
                "CancelTransfer",
                "DeclinePull",
                "ListPeers",
                "Checksum",
            },
            {"WatchTransfers"},
        ),
        engine_pb2: (
            "Engine",
            {"Attach", "Describe", "Hold", "WatchReleases", "Detach", "Session"},
            {"WatchReleases", "Session"},
        ),
    }
    for mod, (name, methods, streaming) in expected.items():
        service = mod.DESCRIPTOR.services_by_name[name]
        assert {m.name for m in service.methods} == methods
        for m in service.methods:
            assert m.client_streaming == (m.full_name == "kvxferd.v1.Peer.Stage"), m.name
            assert m.server_streaming == (m.name in streaming), m.name
            assert m.input_type.name == f"{m.name}Request"
            assert m.output_type.name == f"{m.name}Response"
    for grpc_mod in (peer_pb2_grpc, scheduler_pb2_grpc, engine_pb2_grpc):
        assert grpc_mod.__name__.startswith("kvxferd.v1.")


# --- proto mirrors of Python values stay in step ---------------------------------------------


def _upper_snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).upper()


@pytest.mark.parametrize(
    ("py_enum", "proto_enum", "prefix"),
    [
        (spec.GroupKind, spec_pb2.GroupKind, "GROUP_KIND_"),
        (spec.Layout, spec_pb2.Layout, "LAYOUT_"),
        (spec.MemoryType, spec_pb2.MemoryType, "MEMORY_TYPE_"),
        (dtypes.KVDType, spec_pb2.KvDtype, "KV_DTYPE_"),
    ],
)
def test_spec_enums_mirror_python(py_enum: type, proto_enum: object, prefix: str) -> None:
    py_names = {prefix + m.name for m in py_enum}  # type: ignore[attr-defined]
    assert py_names == _enum_values(proto_enum.DESCRIPTOR)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("py_cls", "proto_msg", "renames"),
    [
        (spec.KVGroup, spec_pb2.KvGroup, {}),
        (spec.Region, spec_pb2.KvRegion, {"group": "group_index"}),
        (spec.KVCacheSpec, spec_pb2.KvCacheSpec, {}),
        (errors.Mismatch, common_pb2.Mismatch, {}),
    ],
)
def test_spec_messages_mirror_python(
    py_cls: type, proto_msg: type, renames: dict[str, str]
) -> None:
    py_fields = {renames.get(f.name, f.name) for f in dataclasses.fields(py_cls)}
    assert py_fields == set(proto_msg.DESCRIPTOR.fields_by_name)  # type: ignore[attr-defined]


def test_error_kinds_mirror_the_exception_tree() -> None:
    classes = {
        c
        for c in vars(errors).values()
        if isinstance(c, type)
        and issubclass(c, errors.KvxferdError)
        and c is not errors.KvxferdError
    }
    want = {"ERROR_KIND_" + _upper_snake(c.__name__.removesuffix("Error")) for c in classes}
    assert want == _enum_values(common_pb2.ErrorKind.DESCRIPTOR)


# --- generated code is usable and current ----------------------------------------------------


class _EchoPeer(peer_pb2_grpc.PeerServicer):
    """Every method must be implemented: the generated stubs declare them abstract."""

    def Handshake(  # noqa: N802 - gRPC method name
        self, request: peer_pb2.HandshakeRequest, context: grpc.ServicerContext
    ) -> peer_pb2.HandshakeResponse:
        return peer_pb2.HandshakeResponse(
            protocol_version=request.protocol_version,
            compat_digest=request.compat_digest,
            payload=request.payload,
        )

    def ConfirmLease(  # noqa: N802 - gRPC method name
        self, request: peer_pb2.ConfirmLeaseRequest, context: grpc.ServicerContext
    ) -> peer_pb2.ConfirmLeaseResponse:
        context.abort(grpc.StatusCode.NOT_FOUND, f"no lease for {request.request_id!r}")

    def ExtendLease(  # noqa: N802 - gRPC method name
        self, request: peer_pb2.ExtendLeaseRequest, context: grpc.ServicerContext
    ) -> peer_pb2.ExtendLeaseResponse:
        context.abort(grpc.StatusCode.NOT_FOUND, f"no lease for {request.request_id!r}")

    def ReleaseLease(  # noqa: N802 - gRPC method name
        self, request: peer_pb2.ReleaseLeaseRequest, context: grpc.ServicerContext
    ) -> peer_pb2.ReleaseLeaseResponse:
        context.abort(grpc.StatusCode.NOT_FOUND, f"no lease for {request.request_id!r}")

    def Heartbeat(  # noqa: N802 - gRPC method name
        self, request: peer_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> peer_pb2.HeartbeatResponse:
        return peer_pb2.HeartbeatResponse(
            instance_id="server", lost_request_ids=request.renew_request_ids
        )


def test_generated_stub_and_servicer_talk_over_grpc() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    peer_pb2_grpc.add_PeerServicer_to_server(_EchoPeer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = peer_pb2_grpc.PeerStub(channel)
            req = peer_pb2.HandshakeRequest(protocol_version=1, compat_digest=b"d", payload=b"p")
            assert stub.Handshake(req, timeout=10) == peer_pb2.HandshakeResponse(
                protocol_version=1, compat_digest=b"d", payload=b"p"
            )
            beat = stub.Heartbeat(peer_pb2.HeartbeatRequest(renew_request_ids=["r1"]), timeout=10)
            assert list(beat.lost_request_ids) == ["r1"]
            # Errors travel as status codes, never in a response body.
            with pytest.raises(grpc.RpcError) as err:
                stub.ConfirmLease(peer_pb2.ConfirmLeaseRequest(request_id="r1"), timeout=10)
            assert isinstance(err.value, grpc.Call)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(grace=None)


def _pins_installed() -> bool:
    script = ROOT / "scripts" / "gen_proto.py"
    found = importlib.util.spec_from_file_location("gen_proto", script)
    assert found is not None and found.loader is not None, f"cannot load {script}"
    gen = importlib.util.module_from_spec(found)
    found.loader.exec_module(gen)
    pinned: dict[str, str] = gen.PINNED
    try:
        return all(metadata.version(d) == v for d, v in pinned.items())
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _pins_installed(), reason="pinned code generators not installed")
def test_checked_in_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "kvxferd/v1").iterdir()}
    here = {
        p.name: p.read_bytes()
        for p in (ROOT / "kvxferd/v1").iterdir()
        if p.is_file() and "_pb2" in p.name
    }
    assert sorted(fresh) == sorted(here)
    stale = [name for name in fresh if fresh[name] != here[name]]
    assert not stale, f"regenerate with: python scripts/gen_proto.py (stale: {stale})"
