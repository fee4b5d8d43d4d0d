"""plan_pull against an independent byte-level oracle (properties).

The oracle is derived from docs/domain.md (§2 layouts, §3-§5 pairing, §6 TP) and docs/tp.md,
not from the planner: every byte of every region is a function of model-global coordinates
(layer, K/V half, token position, global KV head, byte in the head row; state index; MLA
token), each prefill rank's buffers hold exactly what that rank holds, and after executing
every decode rank's plan each decode byte must equal what that rank must hold for its heads,
written exactly once, and nothing else may change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvxferd.blocks import plan_pull
from kvxferd.client.ranks import TPModel, ranks_to_pull, read_ranks
from kvxferd.errors import KvxferdError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, Region

SETTINGS = settings(
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

GARBAGE = 255  # remote bytes outside the request, and padding


# ---------------------------------------------------------------- oracle values


def _mix(key: np.ndarray) -> np.ndarray:
    x = key.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    return (x % np.uint64(250) + np.uint64(1)).astype(np.uint8)


def attn_values(
    region: int, layers: np.ndarray, tokens: np.ndarray, heads: np.ndarray, row_bytes: int
) -> np.ndarray:
    """Values of shape (layers, 2, tokens, heads, row_bytes) (logical NHD order)."""
    lay = layers[:, None, None, None, None].astype(np.int64)
    half = np.arange(2)[None, :, None, None, None]
    tok = tokens[None, None, :, None, None].astype(np.int64)
    hd = heads[None, None, None, :, None].astype(np.int64)
    by = np.arange(row_bytes)[None, None, None, None, :]
    key = (((((region * 64 + lay) * 2 + half) * 100_000 + tok) * 64 + hd) * 4096) + by
    return _mix(key + 1)


def flat_values(region: int, kind: int, index: np.ndarray, nbytes: int, extra: int = 0):
    """MLA (index = token) or state (index = state position) values: (len(index), nbytes)."""
    key = (
        ((((7 + kind) * 1000 + region) * 64 + extra) * 1_000_000 + index[:, None].astype(np.int64))
        * 65536
    ) + np.arange(nbytes)[None, :]
    return _mix(key)


# ---------------------------------------------------------------- model and specs


@dataclass(frozen=True)
class Model:
    kind: str  # "attn" | "mla"
    heads: int  # total KV heads (attn)
    head_size: int
    layers: int
    cross_layer: bool
    dtypes: tuple[KVDType, ...]  # per layer (per-layer regions) or one (cross-layer)
    mamba: bool
    state_len: int
    latent: int


@dataclass(frozen=True)
class Side:
    tp: int
    kernel: int
    logical: int
    head_major: bool
    pad: int  # extra bytes between blocks (0: dense)
    logical_blocks: int
    states: int


def heads_per_rank(total: int, tp: int) -> tuple[int, bool]:
    """(heads per rank, replicated) from docs/domain.md §6."""
    if tp <= total:
        return total // tp, False
    return 1, True


def owned_heads(rank: int, tp: int, total: int) -> list[int]:
    if tp <= total:
        per = total // tp
        return list(range(rank * per, rank * per + per))
    return [rank // (tp // total)]


def layout_of(model: Model, side: Side) -> Layout:
    if model.cross_layer:
        return Layout.CROSS_LAYER_HND if side.head_major else Layout.CROSS_LAYER_NHD
    return Layout.HND if side.head_major else Layout.NHD


def build_spec(model: Model, side: Side) -> KVCacheSpec:
    nk = side.logical_blocks * (side.logical // side.kernel)
    regions: list[Region] = []
    if model.kind == "attn":
        g0 = KVGroup("attn", GroupKind.FULL_ATTENTION, side.logical, side.kernel)
        h, _ = heads_per_rank(model.heads, side.tp)
        inner = (2, side.kernel, h, model.head_size)
        lay = layout_of(model, side)
        if model.cross_layer:
            shape = (model.layers, nk, *inner)
            r = Region("layers", 0, model.dtypes[0], lay, shape)
            regions.append(_padded(r, side.pad))
        else:
            for i in range(model.layers):
                r = Region(f"layer.{i}", 0, model.dtypes[i], lay, (nk, *inner))
                regions.append(_padded(r, side.pad))
    else:
        g0 = KVGroup("mla", GroupKind.MLA, side.logical, side.kernel)
        for i in range(model.layers):
            r = Region(f"mla.{i}", 0, KVDType.BF16, Layout.MLA, (nk, side.kernel, model.latent))
            regions.append(_padded(r, side.pad))
    groups = [g0]
    if model.mamba:
        groups.append(KVGroup("mamba", GroupKind.MAMBA, side.logical, side.logical))
        for i in range(2):
            regions.append(
                Region(f"mamba.{i}", 1, KVDType.FP32, Layout.STATE, (side.states, model.state_len))
            )
    return KVCacheSpec("m", tuple(groups), tuple(regions))


def _padded(r: Region, pad: int) -> Region:
    if not pad:
        return r
    return Region(r.name, r.group, r.dtype, r.layout, r.shape, block_stride=r.block_len + pad)


def block_offsets(layout: Layout, layers: int, tokens: int, heads: int, row: int) -> np.ndarray:
    """Byte offset inside one block of each (layer, half, token, head, byte) (docs §2 table)."""
    lay = np.arange(layers)[:, None, None, None, None]
    half = np.arange(2)[None, :, None, None, None]
    t = np.arange(tokens)[None, None, :, None, None]
    h = np.arange(heads)[None, None, None, :, None]
    b = np.arange(row)[None, None, None, None, :]
    if layout in (Layout.NHD, Layout.CROSS_LAYER_NHD):
        return ((((lay * 2 + half) * tokens + t) * heads + h) * row) + b
    return ((((lay * 2 + half) * heads + h) * tokens + t) * row) + b


# ---------------------------------------------------------------- fill and expect


def token_table(ids: list[int], logical: int, kernel: int, first_token: int) -> dict[int, int]:
    """kernel block ID -> first token position, for a list of logical IDs (docs §3, §4)."""
    ppl = logical // kernel
    out = {}
    for i, lid in enumerate(ids):
        for j in range(ppl):
            out[lid * ppl + j] = first_token + i * logical + j * kernel
    return out


def fill_side(
    model: Model,
    spec: KVCacheSpec,
    side: Side,
    rank: int,
    attn_ids: list[int],
    *,
    first_token: int,
    state_ids: list[int],
    state_first: int,
    token_limit: tuple[int, int] | None,
    sharded_state: bool,
    background: int,
) -> list[np.ndarray]:
    """Buffers of one rank. ``token_limit``: only tokens in [lo, hi) get values (the rest of
    the listed blocks keep ``background``), used for the decode side's expectation."""
    bufs = []
    table = token_table(attn_ids, side.logical, side.kernel, first_token)
    for ri, r in enumerate(spec.regions):
        buf = np.full(r.nbytes, background, dtype=np.uint8)
        if r.layout is Layout.STATE:
            vals = flat_values(
                ri,
                2,
                np.arange(len(state_ids)) + state_first,
                r.block_len,
                rank if sharded_state else 0,
            )
            for i, sid in enumerate(state_ids):
                buf[sid * r.stride : sid * r.stride + r.block_len] = vals[i]
            bufs.append(buf)
            continue
        for kb, t0 in table.items():
            toks = np.arange(t0, t0 + side.kernel)
            keep = np.ones(side.kernel, bool)
            if token_limit is not None:
                keep = (toks >= token_limit[0]) & (toks < token_limit[1])
            if not keep.any():
                continue
            base = kb * r.stride
            if r.layout is Layout.MLA:
                row = model.latent * 2
                vals = flat_values(ri, 1, toks, row)
                blk = buf[base : base + r.block_len].reshape(side.kernel, row)
                blk[keep] = vals[keep]
                continue
            item = r.dtype.itemsize
            row = model.head_size * item
            heads = np.array(owned_heads(rank, side.tp, model.heads))
            layers = np.arange(model.layers) if model.cross_layer else np.array([int(r.name[6:])])
            region_id = 0
            vals = attn_values(region_id, layers, toks, heads, row)
            offs = block_offsets(r.layout, len(layers), side.kernel, len(heads), row)
            sel = np.broadcast_to(keep[None, None, :, None, None], offs.shape)
            buf[base + offs[sel]] = vals[sel]
        bufs.append(buf)
    return bufs


# ---------------------------------------------------------------- strategies


@st.composite
def scenarios(draw):
    kind = draw(st.sampled_from(["attn", "attn", "attn", "mla"]))
    p_tp = draw(st.sampled_from([1, 2, 4, 3, 6, 8]))
    d_tp = draw(st.sampled_from([1, 2, 4, 3, 6, 8]))
    assume(max(p_tp, d_tp) % min(p_tp, d_tp) == 0)
    heads = draw(st.sampled_from([1, 2, 4, 8, 3, 6]))
    for tp in (p_tp, d_tp):  # the model must be servable at both TP sizes (docs/domain.md §6)
        assume((heads % tp == 0) if tp <= heads else (tp % heads == 0))
    cross = kind == "attn" and draw(st.booleans())
    layers = draw(st.integers(1, 3))
    dts = [KVDType.BF16, KVDType.FP8_E4M3, KVDType.FP32]
    dtypes = tuple(draw(st.sampled_from(dts)) for _ in range(1 if cross else layers))
    model = Model(
        kind=kind,
        heads=heads,
        head_size=draw(st.sampled_from([1, 2, 3])),
        layers=layers,
        cross_layer=cross,
        dtypes=dtypes,
        mamba=draw(st.booleans()),
        state_len=draw(st.sampled_from([1, 3])),
        latent=draw(st.sampled_from([1, 3])),
    )
    chunk = draw(st.sampled_from([1, 2, 4]))
    prefix = draw(st.booleans())

    def side(tp: int, head_major: bool, logical: int | None) -> Side:
        kernel = chunk * draw(st.sampled_from([1, 1, 2, 3]))
        if logical is None:
            logical = kernel * draw(st.integers(1, 4))
        else:
            assume(logical % kernel == 0)
        return Side(
            tp=tp,
            kernel=kernel,
            logical=logical,
            head_major=head_major,
            pad=draw(st.sampled_from([0, 0, 2])),
            logical_blocks=draw(st.integers(4, 8)),
            states=draw(st.integers(3, 5)),
        )

    hm = draw(st.booleans())  # head-major on both sides, else NHD on both
    remote = side(p_tp, hm, None)
    same_logical = prefix or draw(st.booleans())
    local = side(d_tp, hm, remote.logical if same_logical else None)
    small, large = sorted((local.kernel, remote.kernel))
    assume(large % small == 0)
    return model, local, remote, prefix, draw(st.randoms(use_true_random=False))


def sliced(model: Model, local: Side, remote: Side) -> bool:
    if model.kind != "attn":
        return False
    return heads_per_rank(model.heads, local.tp)[0] != heads_per_rank(model.heads, remote.tp)[0]


@given(scenarios())
@SETTINGS
def test_plans_move_exactly_each_decode_ranks_bytes(sc) -> None:
    check_scenario(*sc)


def check_scenario(model: Model, local: Side, remote: Side, prefix: bool, rnd) -> None:
    lspec, rspec = build_spec(model, local), build_spec(model, remote)
    ll, lr = local.logical, remote.logical
    # a prompt both sides hold (remote IDs from token 0)
    n_tok = rnd.randint(1, min(local.logical_blocks * ll, remote.logical_blocks * lr))
    n_r = -(-n_tok // lr)
    r_ids = rnd.sample(range(remote.logical_blocks), n_r)
    if prefix:  # equal logical sizes: the local side holds the uncached tail
        n_l = n_r - rnd.randint(0, n_r)
        l_first = (n_r - n_l) * ll
    else:
        n_l = -(-n_tok // ll)
        l_first = 0
    l_ids = rnd.sample(range(local.logical_blocks), n_l)
    n_sr = rnd.randint(1, 3)
    n_sl = n_sr - (rnd.randint(0, n_sr) if prefix else 0)
    rs_ids = rnd.sample(range(remote.states), n_sr)
    ls_ids = rnd.sample(range(local.states), n_sl)
    lo, hi = l_first, min(l_first + n_l * ll, n_r * lr)
    local_ids = [l_ids] + ([ls_ids] if model.mamba else [])
    remote_ids = [r_ids] + ([rs_ids] if model.mamba else [])

    expect_refusal = None
    if sliced(model, local, remote) and not local.head_major:
        expect_refusal = "NHD slicing"
    if model.mamba and local.tp != remote.tp:
        pass  # states of equal length (replicated): allowed
    sharded_state = local.tp == remote.tp

    remote_bufs = {
        r: fill_side(
            model,
            rspec,
            remote,
            r,
            r_ids,
            first_token=0,
            state_ids=rs_ids,
            state_first=0,
            token_limit=None,
            sharded_state=sharded_state,
            background=GARBAGE,
        )
        for r in range(remote.tp)
    }
    tp_model = TPModel(
        kv_heads=model.heads if model.kind == "attn" else 0,
        mla=model.kind == "mla",
        state=model.mamba,
    )
    notified: set[int] = set()
    for d in range(local.tp):
        try:
            plan = plan_pull(
                lspec,
                rspec,
                local_ids,
                remote_ids,
                prefix_caching=prefix,
                local_tp=(d, local.tp),
                remote_tp=(0, remote.tp),
            )
        except KvxferdError as e:
            assert expect_refusal is not None, f"unexpected refusal: {e!r}"
            assert e.field and e.fix, e
            return
        assert expect_refusal is None, f"expected refusal ({expect_refusal}), got a plan"
        got = [np.zeros(r.nbytes, np.uint8) for r in lspec.regions]
        count = [np.zeros(r.nbytes, np.int32) for r in lspec.regions]
        for r, part in plan.per_rank.items():
            assert 0 <= r < remote.tp
            for rg in part.ranges:
                dst, src = got[rg.region], remote_bufs[r][rg.region]
                for lo_, ro_, n in zip(
                    rg.local_offset.tolist(),
                    rg.remote_offset.tolist(),
                    rg.length.tolist(),
                    strict=True,
                ):
                    assert n > 0
                    assert lo_ >= 0 and lo_ + n <= dst.shape[0], ("local OOB", rg.name)
                    assert ro_ >= 0 and ro_ + n <= src.shape[0], ("remote OOB", rg.name)
                    dst[lo_ : lo_ + n] = src[ro_ : ro_ + n]
                    count[rg.region][lo_ : lo_ + n] += 1
        want = fill_side(
            model,
            lspec,
            local,
            d,
            l_ids,
            first_token=l_first,
            state_ids=ls_ids,
            state_first=n_sr - n_sl,
            token_limit=(lo, hi),
            sharded_state=sharded_state,
            background=0,
        )
        # sharded states at equal TP: local rank d's state is remote rank d's
        for i, r in enumerate(lspec.regions):
            bad = np.flatnonzero(got[i] != want[i])
            assert not bad.size, (
                f"decode rank {d}: region {r.name} byte {bad[0]} got {got[i][bad[0]]}"
                f" want {want[i][bad[0]]} ({bad.size} bad)"
            )
            twice = np.flatnonzero(count[i] > 1)
            assert not twice.size, f"decode rank {d}: region {r.name} byte {twice[0]} written twice"
        read = sorted(r for r, p in plan.per_rank.items() if p.nbytes)
        if read:
            assert set(read) <= set(read_ranks(tp_model, d, local.tp, remote.tp)), (
                read,
                read_ranks(tp_model, d, local.tp, remote.tp),
            )
            assert set(read) <= set(ranks_to_pull(tp_model, d, local.tp, remote.tp))
        notified |= set(plan.notify_ranks)
    assert notified == set(range(remote.tp))


# ---------------------------------------------------------------- refusal wording


def _fa(logical: int, kernel: int, blocks: int) -> KVCacheSpec:
    g = KVGroup("a", GroupKind.FULL_ATTENTION, logical, kernel)
    r = Region("l", 0, KVDType.BF16, Layout.HND, (blocks, 2, kernel, 2, 4))
    return KVCacheSpec("m", (g,), (r,))


def test_untileable_kernel_sizes_refusal_names_the_group_field() -> None:
    """docs/domain.md §5 rule 3: kernel 16 vs 24 is refused; the refusal must name the field
    (groups[0]) like every other per-group refusal of plan_pull, not ``""``."""
    with pytest.raises(KvxferdError) as got:
        plan_pull(_fa(48, 16, 30), _fa(48, 24, 20), [[0]], [[0]], prefix_caching=False)
    assert got.value.fix
    assert got.value.field == "groups[0]", got.value.field


def test_chunked_prefix_refusal_names_the_real_block_sizes() -> None:
    """Both sides have ppl 4 (64/16 and 128/32); what differs is the logical block size, so
    the refusal must not claim ``remote ppl 8``."""
    with pytest.raises(KvxferdError) as got:
        plan_pull(_fa(64, 16, 32), _fa(128, 32, 32), [[0]], [[0]], prefix_caching=True)
    assert "ppl 8" not in str(got.value), str(got.value)
    assert "64" in str(got.value) and "128" in str(got.value), str(got.value)
