"""Is a peer compatible? A pure check that lists every mismatch, each with its fix.

Both sides of a handshake run :func:`check_compatible` with themselves as ``local``; every rule
is symmetric, so the two sides refuse each other or neither does. What is checked (docs/domain.md
§7): protocol version, model fingerprint, TP sizes dividing each other, prefix caching on or
off alike, the same transfer mode (``transfer.mode``: pull or push), KV cache groups (count,
kind, kernel block size, ``ppl`` while prefix caching is on), and regions paired by name and
position (dtype, layout, shape and KV heads per rank against the TP slice arithmetic). Memory
type (DRAM/VRAM), block counts and block strides may differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvxferd.blocks.reblock import compatible_kernel_sizes
from kvxferd.errors import IncompatiblePeer, InvalidRequest, Mismatch
from kvxferd.layout.spec import KVCacheSpec, KVGroup
from kvxferd.peers._regions import RegionContext, check_regions
from kvxferd.peers._tp import tp_ratio
from kvxferd.peers.version import PROTOCOL_VERSION, compat_digest

TRANSFER_MODES = ("pull", "push")
"""``transfer.mode``: the decode daemon READs (``pull``) or the prefill daemon WRITEs
(``push``); one deployment uses one mode (docs/nixl.md, push mode)."""


@dataclass(frozen=True, kw_only=True)
class PeerInfo:
    """What one side advertises in the handshake that compatibility depends on.

    ``num_kv_heads`` is the model's KV-head count before TP slicing, when the side knows it;
    without it, it is inferred from the heads per rank (exact unless a rank holds one head,
    which TP > KV heads replicates). ``name`` only labels errors (an address or engine ID).
    ``transfer_mode`` is one of :data:`TRANSFER_MODES`; both sides must advertise the same.
    """

    spec: KVCacheSpec
    tp_rank: int
    tp_size: int
    prefix_caching: bool
    protocol_version: int = PROTOCOL_VERSION
    num_kv_heads: int | None = None
    name: str = ""
    transfer_mode: str = "pull"

    def __post_init__(self) -> None:
        if self.transfer_mode not in TRANSFER_MODES:
            raise InvalidRequest(
                f"unknown transfer mode {self.transfer_mode!r}",
                field="transfer_mode",
                fix='advertise transfer.mode = "pull" or "push"',
            )
        if self.tp_size < 1:
            raise InvalidRequest(
                f"TP size must be >= 1, got {self.tp_size}",
                field="tp_size",
                fix="advertise the worker's tensor-parallel size",
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidRequest(
                f"TP rank {self.tp_rank} is outside 0..{self.tp_size - 1}",
                field="tp_rank",
                fix="advertise the worker's rank within its TP group",
            )
        if self.protocol_version < 1:
            raise InvalidRequest(
                f"protocol version must be >= 1, got {self.protocol_version}",
                field="protocol_version",
                fix=f"this build speaks protocol {PROTOCOL_VERSION}",
            )
        if self.num_kv_heads is not None and self.num_kv_heads < 1:
            raise InvalidRequest(
                f"num_kv_heads must be >= 1 when given, got {self.num_kv_heads}",
                field="num_kv_heads",
                fix="leave it out or give the model's KV heads before TP slicing",
            )

    def compat_digest(self, *, allow_layout_conversion: bool = False) -> str:
        """This side's :func:`~kvxferd.peers.version.compat_digest` as the handshake sends it."""
        return compat_digest(
            self.spec,
            protocol_version=self.protocol_version,
            include_layout=not allow_layout_conversion,
        )

    def describe(self) -> str:
        who = f"{self.name} " if self.name else ""
        return (
            f"{who}protocol {self.protocol_version} TP {self.tp_rank}/{self.tp_size} prefix"
            f" caching {_onoff(self.prefix_caching)}; {self.spec.describe()}"
        )


@dataclass(frozen=True)
class CompatReport:
    """Every mismatch found (empty: compatible) and the TP ratio (None: TP sizes don't divide).

    ``tp_ratio`` follows docs/domain.md §6 with ``local`` in the decode role: ``local // remote``
    when local TP >= remote TP, else ``-(remote // local)``.
    """

    mismatches: tuple[Mismatch, ...]
    tp_ratio: int | None

    @property
    def compatible(self) -> bool:
        return not self.mismatches

    def __len__(self) -> int:
        return len(self.mismatches)

    def __iter__(self) -> Iterator[Mismatch]:
        return iter(self.mismatches)

    def raise_if_incompatible(self, *, peer: str = "") -> None:
        """Raise :class:`IncompatiblePeer` listing every mismatch, if there is any."""
        if self.mismatches:
            raise IncompatiblePeer(self.mismatches, peer=peer)


def check_compatible(
    local: PeerInfo, remote: PeerInfo, *, allow_layout_conversion: bool = False
) -> CompatReport:
    """Compare two peers' handshake info; return every mismatch (pure, never raises).

    ``allow_layout_conversion``: an explicit NHD <-> HND conversion is configured, so those
    layouts may differ (never MLA/state vs attention, never per-layer vs cross-layer).
    """
    out: list[Mismatch] = []
    if local.protocol_version != remote.protocol_version:
        out.append(
            Mismatch(
                "protocol version",
                str(local.protocol_version),
                str(remote.protocol_version),
                f"run the same kvxferd protocol on both sides (this build speaks"
                f" {PROTOCOL_VERSION}): upgrade the older daemon",
            )
        )
    if local.spec.model != remote.spec.model:
        out.append(
            Mismatch(
                "model fingerprint",
                repr(local.spec.model),
                repr(remote.spec.model),
                "serve the same model (and revision) on both sides",
            )
        )
    ratio = tp_ratio(local.tp_size, remote.tp_size)
    if ratio is None:
        out.append(
            Mismatch(
                "tensor-parallel size",
                f"TP {local.tp_size}",
                f"TP {remote.tp_size}",
                "choose TP sizes where one divides the other (e.g. prefill TP 2 with decode TP"
                " 1, 2, 4 or 8)",
            )
        )
    heads_l, heads_r = local.num_kv_heads, remote.num_kv_heads
    if heads_l is not None and heads_r is not None and heads_l != heads_r:
        out.append(
            Mismatch(
                "model KV heads (before TP)",
                str(heads_l),
                str(heads_r),
                "serve the same model on both sides",
            )
        )
        heads_l = heads_r = None  # reported once here, not again per region
    if local.prefix_caching != remote.prefix_caching:
        out.append(
            Mismatch(
                "prefix caching",
                _onoff(local.prefix_caching),
                _onoff(remote.prefix_caching),
                "enable or disable prefix caching on both sides alike",
            )
        )
    if local.transfer_mode != remote.transfer_mode:
        out.append(_mode_mismatch(local.transfer_mode, remote.transfer_mode))
    prefix = local.prefix_caching or remote.prefix_caching
    out.extend(_check_groups(local.spec, remote.spec, prefix_caching=prefix))
    ctx = RegionContext(
        local_tp=local.tp_size,
        remote_tp=remote.tp_size,
        tp_ratio=ratio,
        local_kv_heads=heads_l,
        remote_kv_heads=heads_r,
        allow_layout_conversion=allow_layout_conversion,
    )
    out.extend(check_regions(local.spec, remote.spec, ctx))
    return CompatReport(tuple(out), ratio)


def require_compatible(
    local: PeerInfo, remote: PeerInfo, *, allow_layout_conversion: bool = False
) -> CompatReport:
    """:func:`check_compatible`, raising :class:`IncompatiblePeer` (all mismatches) if any."""
    report = check_compatible(local, remote, allow_layout_conversion=allow_layout_conversion)
    report.raise_if_incompatible(peer=remote.name)
    return report


def _mode_mismatch(local: str, remote: str) -> Mismatch:
    return Mismatch(
        "transfer mode (transfer.mode)",
        repr(local),
        repr(remote),
        f"one deployment uses one mode: set transfer.mode = {remote!r} on the daemon that"
        f" runs {local!r}, or {local!r} on the one that runs {remote!r}, and restart it; every"
        " prefill and decode daemon that pair with each other must agree",
    )


def _check_groups(
    local: KVCacheSpec, remote: KVCacheSpec, *, prefix_caching: bool
) -> Iterator[Mismatch]:
    if len(local.groups) != len(remote.groups):
        yield Mismatch(
            "KV cache groups",
            _groups(local.groups),
            _groups(remote.groups),
            "serve the same model with the same attention types on both sides (groups pair"
            " by position)",
        )
    for i, (gl, gr) in enumerate(zip(local.groups, remote.groups, strict=False)):
        label = f"group #{i} " + (
            repr(gl.name) if gl.name == gr.name else f"(local {gl.name!r}, remote {gr.name!r})"
        )
        if gl.kind is not gr.kind:
            yield Mismatch(
                f"{label}: kind",
                gl.kind.value,
                gr.kind.value,
                "serve the same model on both sides (groups pair by position and kind)",
            )
            continue
        kl, kr = gl.kernel_block_size, gr.kernel_block_size
        if not gl.kind.is_state and kl != kr:
            if max(kl, kr) % min(kl, kr):
                works = compatible_kernel_sizes(kl, gr.logical_block_size)
                yield Mismatch(
                    f"{label}: kernel block size (tokens)",
                    str(kl),
                    str(kr),
                    "kernel block sizes must be multiples of one another (pulls re-block at"
                    f" the smaller one, docs/domain.md §5): run the remote with one of {works}"
                    f" or this side with one of"
                    f" {compatible_kernel_sizes(kr, gl.logical_block_size)}",
                )
            elif prefix_caching and gl.logical_block_size != gr.logical_block_size:
                yield Mismatch(
                    f"{label}: logical block size (tokens) with prefix caching on",
                    str(gl.logical_block_size),
                    str(gr.logical_block_size),
                    "with different kernel block sizes and prefix caching on, the logical"
                    " block sizes must be equal (a cached prefix is counted in logical"
                    " blocks; docs/domain.md §5): equalise them or disable prefix caching",
                )
            continue
        if prefix_caching and gl.ppl != gr.ppl:
            yield Mismatch(
                f"{label}: kernel blocks per logical block (ppl) with prefix caching on",
                _ppl(gl),
                _ppl(gr),
                f"disable prefix caching on both sides: ppl local {gl.ppl} vs remote {gr.ppl}"
                " with prefix caching on silently corrupts data (docs/domain.md §5)",
            )


def _groups(groups: tuple[KVGroup, ...]) -> str:
    return f"{len(groups)} (" + ", ".join(f"{g.name}:{g.kind.value}" for g in groups) + ")"


def _ppl(g: KVGroup) -> str:
    return f"{g.ppl} (logical {g.logical_block_size} / kernel {g.kernel_block_size} tokens)"


def _onoff(flag: bool) -> str:
    return "on" if flag else "off"
