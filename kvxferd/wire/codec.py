"""Conversions between kvxferd's values and the ``kvxferd.v1`` wire messages.

Decoding is strict: an unknown enum value or an impossible shape becomes a ``SpecError`` /
``InvalidRequest`` naming the field, never a crash. Sizes travel as uint64 but every table the
daemon builds from them (region rows, descriptor arrays) is int64: a spec whose dims, strides or
region sizes do not fit below 2^63 is refused here, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.bounds import SMALL_IDS
from kvxferd.errors import InvalidRequest, KvxferdError, SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, MemoryType, Region
from kvxferd.v1 import common_pb2, peer_pb2, spec_pb2

_KIND = {
    GroupKind.FULL_ATTENTION: spec_pb2.GROUP_KIND_FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW: spec_pb2.GROUP_KIND_SLIDING_WINDOW,
    GroupKind.MLA: spec_pb2.GROUP_KIND_MLA,
    GroupKind.MAMBA: spec_pb2.GROUP_KIND_MAMBA,
}
_DTYPE = {
    KVDType.BF16: spec_pb2.KV_DTYPE_BF16,
    KVDType.FP16: spec_pb2.KV_DTYPE_FP16,
    KVDType.FP32: spec_pb2.KV_DTYPE_FP32,
    KVDType.FP8_E4M3: spec_pb2.KV_DTYPE_FP8_E4M3,
    KVDType.FP8_E5M2: spec_pb2.KV_DTYPE_FP8_E5M2,
}
_LAYOUT = {
    Layout.NHD: spec_pb2.LAYOUT_NHD,
    Layout.HND: spec_pb2.LAYOUT_HND,
    Layout.CROSS_LAYER_NHD: spec_pb2.LAYOUT_CROSS_LAYER_NHD,
    Layout.CROSS_LAYER_HND: spec_pb2.LAYOUT_CROSS_LAYER_HND,
    Layout.MLA: spec_pb2.LAYOUT_MLA,
    Layout.STATE: spec_pb2.LAYOUT_STATE,
}
T = TypeVar("T")

_MEMORY = {MemoryType.DRAM: spec_pb2.MEMORY_TYPE_DRAM, MemoryType.VRAM: spec_pb2.MEMORY_TYPE_VRAM}

INT64_MAX = (1 << 63) - 1


def _inverse(table: Mapping[T, int], name: str, value: int, where: str) -> T:
    for k, v in table.items():
        if v == value:
            return k
    raise SpecError(f"unknown {name} value {value}", field=where, fix="upgrade the older daemon")


def spec_to_proto(spec: KVCacheSpec) -> spec_pb2.KvCacheSpec:
    msg = spec_pb2.KvCacheSpec(model=spec.model)
    for g in spec.groups:
        msg.groups.add(
            name=g.name,
            kind=_KIND[g.kind],
            logical_block_size=g.logical_block_size,
            kernel_block_size=g.kernel_block_size,
        )
    for r in spec.regions:
        msg.regions.add(
            name=r.name,
            group_index=r.group,
            dtype=_DTYPE[r.dtype],
            layout=_LAYOUT[r.layout],
            shape=list(r.shape),
            memory=_MEMORY[r.memory],
            block_stride=r.block_stride,
        )
    return msg


def _check_int64(msg: spec_pb2.KvCacheSpec, where: str) -> None:
    for i, r in enumerate(msg.regions):
        for d, dim in enumerate(r.shape):
            if dim > INT64_MAX:
                raise SpecError(
                    f"shape dim {d} of region {r.name!r} is {dim}, not below 2^63",
                    field=f"{where}.regions[{i}].shape[{d}]",
                    fix="send the region's real shape",
                )
        if r.block_stride > INT64_MAX:
            raise SpecError(
                f"block_stride of region {r.name!r} is {r.block_stride}, not below 2^63",
                field=f"{where}.regions[{i}].block_stride",
                fix="send the region's real block stride (0 for a dense tensor)",
            )


def _check_sizes(spec: KVCacheSpec, where: str) -> None:
    for i, r in enumerate(spec.regions):
        if r.nbytes > INT64_MAX:
            raise SpecError(
                f"region {r.name!r} would span {r.nbytes} bytes, not below 2^63",
                field=f"{where}.regions[{i}]",
                fix="send the region's real shape and block stride",
            )


def spec_from_proto(msg: spec_pb2.KvCacheSpec, where: str = "spec") -> KVCacheSpec:
    _check_int64(msg, where)
    try:
        groups = tuple(
            KVGroup(
                g.name,
                _inverse(_KIND, "group kind", g.kind, f"{where}.groups[{i}].kind"),
                g.logical_block_size,
                g.kernel_block_size,
            )
            for i, g in enumerate(msg.groups)
        )
        regions = tuple(
            Region(
                name=r.name,
                group=r.group_index,
                dtype=_inverse(_DTYPE, "dtype", r.dtype, f"{where}.regions[{i}].dtype"),
                layout=_inverse(_LAYOUT, "layout", r.layout, f"{where}.regions[{i}].layout"),
                shape=tuple(int(d) for d in r.shape),
                memory=_inverse(_MEMORY, "memory", r.memory, f"{where}.regions[{i}].memory"),
                block_stride=r.block_stride,
            )
            for i, r in enumerate(msg.regions)
        )
        spec = KVCacheSpec(msg.model, groups, regions)
        _check_sizes(spec, where)
        return spec
    except KvxferdError:
        raise
    except (TypeError, ValueError) as exc:
        raise SpecError(f"malformed spec: {exc}", field=where) from exc


_MODE = {"pull": peer_pb2.TRANSFER_MODE_PULL, "push": peer_pb2.TRANSFER_MODE_PUSH}


def mode_to_proto(mode: str) -> peer_pb2.TransferMode.ValueType:
    """``transfer.mode`` as the handshake carries it."""
    return _MODE[mode]


def mode_from_proto(value: int, where: str = "payload.transfer_mode") -> str:
    """The handshake's transfer mode; unset (an older peer, which only pulls) is ``pull``."""
    if value == peer_pb2.TRANSFER_MODE_UNSPECIFIED:
        return "pull"
    return _inverse(_MODE, "transfer mode", value, where)


def group_ids_to_proto(
    groups: Sequence[Sequence[int] | npt.NDArray[np.int64]],
) -> common_pb2.GroupBlockIds:
    msg = common_pb2.GroupBlockIds()
    for ids in groups:
        # An array's tolist() gives Python ints in one C call (a 512-ID lease: ~12 us, not ~40)
        msg.groups.add(ids=ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids])
    return msg


def group_ids_from_proto(msg: common_pb2.GroupBlockIds) -> list[npt.NDArray[np.int64]]:
    return [_ids_array(g.ids) for g in msg.groups]


def _ids_array(ids: Sequence[int]) -> npt.NDArray[np.int64]:
    """A repeated int64 field as an array. A short one through a list (its slice, one C
    call): NumPy's discovery of the protobuf container costs more than the copy (~2 vs ~0.9
    µs for 16 IDs)."""
    if len(ids) <= SMALL_IDS:
        return np.array(ids[:], dtype=np.int64)
    return np.asarray(ids, dtype=np.int64)


def require(cond: bool, message: str, field: str, fix: str = "") -> None:
    if not cond:
        raise InvalidRequest(message, field=field, fix=fix)
