"""Region-by-region checks (private to :mod:`kvxferd.peers.compat`).

Regions pair by name and position. Each pair is checked for group, dtype, layout, TP-invariant
shape and, for attention, KV heads per rank against the two TP sizes. Identical findings on
several regions (say 32 layers in NHD) are merged into one :class:`Mismatch` naming them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvxferd.errors import Mismatch
from kvxferd.layout.spec import KVCacheSpec, Region
from kvxferd.peers._shapes import invariant_shape, layout_family
from kvxferd.peers._tp import heads_per_rank, total_heads_candidates

# (topic, local, remote, fix) for one region; merged over regions by ``check_regions``.
_Finding = tuple[str, str, str, str]


@dataclass(frozen=True)
class RegionContext:
    """What the region checks need beyond the two specs."""

    local_tp: int
    remote_tp: int
    tp_ratio: int | None  # None: the TP sizes do not divide (reported once, elsewhere)
    local_kv_heads: int | None  # the model's KV heads as each side declares them, if it does
    remote_kv_heads: int | None
    allow_layout_conversion: bool


def check_regions(local: KVCacheSpec, remote: KVCacheSpec, ctx: RegionContext) -> list[Mismatch]:
    out: list[Mismatch] = []
    lnames = [r.name for r in local.regions]
    rnames = [r.name for r in remote.regions]
    if len(lnames) != len(rnames):
        out.append(
            Mismatch(
                "region count",
                _count(lnames, rnames, "remote"),
                _count(rnames, lnames, "local"),
                "register the same regions in the same order on both sides (same model, same"
                " per-layer or cross-layer registration)",
            )
        )
    merged: dict[_Finding, list[str]] = {}
    for i, (lr, rr) in enumerate(zip(local.regions, remote.regions, strict=False)):
        if lr.name != rr.name:
            out.append(
                Mismatch(
                    f"region #{i}: name",
                    repr(lr.name),
                    repr(rr.name),
                    _order_fix(lr.name, rr.name, lnames, rnames),
                )
            )
            continue
        for finding in _check_pair(lr, rr, local, remote, ctx):
            merged.setdefault(finding, []).append(lr.name)
    for (topic, lv, rv, fix), names in merged.items():
        label = (
            f"region {names[0]!r}"
            if len(names) == 1
            else "regions " + ", ".join(repr(n) for n in names)
        )
        out.append(Mismatch(f"{label}: {topic}", lv, rv, fix))
    return out


def _count(mine: list[str], theirs: list[str], other: str) -> str:
    extra = [n for n in mine if n not in set(theirs)]
    text = f"{len(mine)} regions"
    if extra:
        shown = ", ".join(repr(n) for n in extra[:8]) + (" ..." if len(extra) > 8 else "")
        text += f" ({len(extra)} not on the {other} side: {shown})"
    return text


def _order_fix(lname: str, rname: str, lnames: list[str], rnames: list[str]) -> str:
    notes = []
    if lname in rnames:
        notes.append(f"the remote has {lname!r} at #{rnames.index(lname)}")
    else:
        notes.append(f"the remote has no region {lname!r}")
    if rname in lnames:
        notes.append(f"the local side has {rname!r} at #{lnames.index(rname)}")
    else:
        notes.append(f"the local side has no region {rname!r}")
    return "register regions under the same names in the same order on both sides (" + (
        "; ".join(notes) + ")"
    )


def _check_pair(
    lr: Region, rr: Region, lspec: KVCacheSpec, rspec: KVCacheSpec, ctx: RegionContext
) -> Iterator[_Finding]:
    if lr.group != rr.group:
        yield (
            "KV cache group",
            _group(lspec, lr.group),
            _group(rspec, rr.group),
            "put the region in the same group on both sides (groups pair by position)",
        )
    if lr.dtype is not rr.dtype:
        yield (
            "dtype",
            lr.dtype.value,
            rr.dtype.value,
            "use the same KV cache dtype for this layer on both sides (dtypes are per layer:"
            " check kv_cache_dtype and which layers are kept in bf16)",
        )
    lfam, rfam = layout_family(lr.layout), layout_family(rr.layout)
    if lfam != rfam:
        yield (
            "layout",
            f"{lr.layout.value} ({lfam})",
            f"{rr.layout.value} ({rfam})",
            "a region must hold the same kind of cache on both sides, which no layout"
            " conversion changes: check the model and the attention backend",
        )
        return
    hetero = (
        lr.group == rr.group < min(len(lspec.groups), len(rspec.groups))
        and lspec.groups[lr.group].kernel_block_size != rspec.groups[rr.group].kernel_block_size
    )
    yield from _check_shape(lr, rr, without_tokens=hetero)
    sliced = False
    if lr.layout.has_kv_halves and ctx.tp_ratio is not None:
        heads = _check_heads(lr, rr, ctx)
        if heads is not None:
            yield heads
        sliced = lr.num_kv_heads != rr.num_kv_heads if heads is None else ctx.tp_ratio != 1
    unsliceable = [side for side, r in (("local", lr), ("remote", rr)) if not r.layout.head_major]
    if sliced and unsliceable:
        sides = " and ".join(unsliceable) + (" sides" if len(unsliceable) > 1 else " side")
        yield (
            "layout for KV-head slicing",
            lr.layout.value,
            rr.layout.value,
            f"set the HND layout (CROSS_LAYER_HND when cross-layer) on the {sides}: TP local"
            f" {ctx.local_tp} vs remote {ctx.remote_tp} moves per-KV-head slices of each"
            " block, contiguous only in HND",
        )
    elif lr.layout is not rr.layout and not ctx.allow_layout_conversion:
        yield (
            "layout",
            lr.layout.value,
            rr.layout.value,
            "set the same layout on both sides (HND if TP sizes differ), or enable the"
            " explicit layout conversion",
        )


def _group(spec: KVCacheSpec, index: int) -> str:
    g = spec.groups[index]
    return f"#{index} {g.name!r} ({g.kind.value})"


def _check_shape(lr: Region, rr: Region, *, without_tokens: bool) -> Iterator[_Finding]:
    """``without_tokens``: the groups' kernel block sizes differ (checked by the group rules,
    re-blocked by pulls), so the tokens-per-block dim is not compared."""
    linv = invariant_shape(lr, with_tokens=not without_tokens)
    rinv = invariant_shape(rr, with_tokens=not without_tokens)
    if linv == rinv:
        return
    if lr.layout.has_kv_halves:
        yield (
            "shape per KV head (without block and heads dims)",
            str(list(linv)),
            str(list(rinv)),
            "use the same kernel block size and head size (and layer count, cross-layer) on"
            " both sides; only the KV heads per rank may differ, by TP",
        )
    else:
        yield (
            "block shape (replicated across TP, without the block dim)",
            f"{list(linv)} ({lr.block_len} B/block)",
            f"{list(rinv)} ({rr.block_len} B/block)",
            "MLA latents and state blocks are replicated across TP ranks and must be identical:"
            " serve the same model with the same block size on both sides",
        )


def _check_heads(lr: Region, rr: Region, ctx: RegionContext) -> _Finding | None:
    lcand = total_heads_candidates(lr.num_kv_heads, ctx.local_tp, ctx.local_kv_heads)
    rcand = total_heads_candidates(rr.num_kv_heads, ctx.remote_tp, ctx.remote_kv_heads)
    if lcand & rcand:
        return None
    notes = []
    for side, r, tp, declared, cand in (
        ("local", lr, ctx.local_tp, ctx.local_kv_heads, lcand),
        ("remote", rr, ctx.remote_tp, ctx.remote_kv_heads, rcand),
    ):
        if not cand:
            notes.append(
                f"the {side} side declares {declared} KV heads but holds {r.num_kv_heads} per"
                f" rank at TP {tp}"
            )
    if len(lcand) == 1:
        notes.append(_expect(next(iter(lcand)), "local", "remote", rr, ctx.remote_tp))
    if len(rcand) == 1:
        notes.append(_expect(next(iter(rcand)), "remote", "local", lr, ctx.local_tp))
    ratio = ctx.tp_ratio
    if ratio is not None and ratio > 1:
        notes.append(f"heads sliced over TP need local block_len x {ratio} == remote block_len")
    elif ratio is not None and ratio < -1:
        notes.append(f"heads sliced over TP need remote block_len x {-ratio} == local block_len")
    else:
        notes.append("equal TP sizes need equal block_len")
    notes.append("check that both sides serve the same model at the TP sizes they advertise")
    return (
        "KV heads per rank vs TP",
        _heads(lr, ctx.local_tp),
        _heads(rr, ctx.remote_tp),
        "; ".join(notes),
    )


def _heads(r: Region, tp: int) -> str:
    return f"{r.num_kv_heads} KV heads/rank at TP {tp} (block_len {r.block_len} B)"


def _expect(total: int, known: str, other: str, r: Region, tp: int) -> str:
    per_rank = heads_per_rank(total, tp)
    if per_rank is None:
        return f"{total} KV heads (from the {known} side) cannot be split over TP {tp}"
    per_head = r.block_len // r.num_kv_heads
    return (
        f"with {total} KV heads (from the {known} side) the {other} side at TP {tp} should"
        f" hold {per_rank} per rank (block_len {per_head * per_rank} B)"
    )
