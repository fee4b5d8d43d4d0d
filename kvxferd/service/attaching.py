"""Engine attach messages <-> :mod:`kvxferd.daemon.attach` values (decode, check, encode)."""

from __future__ import annotations

from kvxferd.daemon.attach import (
    Attacher,
    AttachRequest,
    ExportHandle,
    ImportHandle,
    MemoryMode,
)
from kvxferd.daemon.core import Daemon
from kvxferd.daemon.slot import SlotState
from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout.presets import preset
from kvxferd.v1 import engine_pb2, spec_pb2
from kvxferd.wire.codec import _DTYPE, _MEMORY, _inverse, spec_from_proto, spec_to_proto

_MODE = {
    engine_pb2.MEMORY_MODE_OWNED: MemoryMode.OWNED,
    engine_pb2.MEMORY_MODE_IMPORTED: MemoryMode.IMPORTED,
}
_MODE_OUT = {v: k for k, v in _MODE.items()}
_STATE = {
    SlotState.DETACHED: engine_pb2.REGISTRATION_STATE_DETACHED,
    SlotState.REGISTERING: engine_pb2.REGISTRATION_STATE_REGISTERING,
    SlotState.REGISTERED: engine_pb2.REGISTRATION_STATE_REGISTERED,
}


def attach_request_from_proto(msg: engine_pb2.AttachRequest) -> AttachRequest:
    source = msg.WhichOneof("source")
    if source == "spec":
        spec = spec_from_proto(msg.spec, "spec")
    elif source == "preset":
        try:
            spec = preset(msg.preset)
        except (SpecError, ValueError, KeyError, TypeError) as exc:
            raise SpecError(
                f"preset {msg.preset!r}: {exc}",
                fix="name a built-in preset (docs/spec.md) or send a full spec",
            ) from exc
    else:
        raise InvalidRequest(
            "the request has neither a spec nor a preset", field="spec", fix="send one of them"
        )
    mode = _MODE.get(msg.memory_mode)
    if mode is None:
        raise InvalidRequest(
            f"memory_mode {_mode_name(msg.memory_mode)} cannot be attached",
            field="memory_mode",
            fix="send MEMORY_MODE_OWNED (the fast path) or MEMORY_MODE_IMPORTED",
        )
    memory = None
    if msg.memory != spec_pb2.MEMORY_TYPE_UNSPECIFIED:
        memory = _inverse(_MEMORY, "memory type", msg.memory, "memory")
    if mode is MemoryMode.OWNED and msg.imports:
        raise InvalidRequest(
            "OWNED attaches take no imports: the daemon allocates and exports the memory",
            field="imports",
            fix="leave imports empty, or use MEMORY_MODE_IMPORTED",
        )
    imports = []
    for i, h in enumerate(msg.imports):
        dtype = None
        if h.dtype != spec_pb2.KV_DTYPE_UNSPECIFIED:
            dtype = _inverse(_DTYPE, "dtype", h.dtype, f"imports[{i}].dtype")
        imports.append(
            ImportHandle(
                region=h.region_name,
                shm_name=h.shm_name,
                cuda_ipc_handle=h.cuda_ipc_handle,
                offset=h.offset,
                device=h.device_id,
                device_uuid=h.device_uuid,
                shape=tuple(h.shape),
                strides=tuple(h.strides),
                dtype=dtype,
            )
        )
    return AttachRequest(
        spec=spec,
        mode=mode,
        memory=memory,
        imports=tuple(imports),
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        prefix_caching=msg.prefix_caching,
    )


def _export_to_proto(e: ExportHandle) -> engine_pb2.MemoryHandle:
    h = engine_pb2.MemoryHandle(
        region_name=e.region, offset=e.offset, nbytes=e.nbytes, device_id=e.device
    )
    if e.cuda_ipc_handle:
        h.cuda_ipc_handle = e.cuda_ipc_handle
        h.device_uuid = e.device_uuid
    else:
        h.shm_name = e.shm_name
    return h


def pool_info(daemon: Daemon, attacher: Attacher | None) -> engine_pb2.PoolInfo:
    """The pool as Describe/Attach report it (state DETACHED and no spec when none)."""
    slot = daemon.slot
    out = engine_pb2.PoolInfo(
        state=_STATE[slot.state],
        registration_generation=slot.generation,
        nixl_agent_name=daemon.agent_name,
        peer_address=daemon.address,
        held_requests=len(daemon.leases),
        scheduler_socket=daemon.scheduler_socket,
    )
    if not slot.registered:
        return out
    me = daemon.describe_self()
    out.spec.CopyFrom(spec_to_proto(me.info.spec))
    out.registrations.extend(me.registrations)
    att = attacher.attachment if attacher is not None else None
    if att is None:
        out.memory_mode = engine_pb2.MEMORY_MODE_OWNED
        return out
    out.memory_mode = _MODE_OUT[att.mode]
    out.exports.extend(_export_to_proto(e) for e in att.exports)
    out.attachment_id = att.attachment_id
    return out


def _mode_name(value: int) -> str:
    """The enum name of a memory mode, or the number when it names none."""
    names = dict(engine_pb2.MemoryMode.items())
    return next((k for k, v in names.items() if v == value), str(value))
