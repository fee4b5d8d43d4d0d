"""The TP scenario's pure part: each rank's spec, the requests, and who pulls from whom.

* :func:`rank_spec`: a preset (``dense``, ``mla``, ``hybrid``, with ``key=value`` options)
  sized for a CPU run and sliced for one rank: the model's KV heads (the preset's
  ``num_kv_heads``) split over the TP size, replicated when the TP size exceeds them.
* :func:`make_requests`: requests with the same logical block IDs on every prefill rank (TP
  ranks share one block table) and on every decode rank.
* :func:`pull_sets`: which prefill ranks each decode rank pulls from: the ranks its plan reads
  (``plan_pull``), plus each rank no decode rank reads with ``rank % decode_tp ==
  decode_rank`` (that pull reads nothing and releases its lease share): the rule
  ``kvxferd.client.ranks`` gives a scheduler (docs/tp.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvxferd.blocks import expand_group, plan_pull
from kvxferd.blocks.tp import kv_head_range
from kvxferd.layout.presets import preset as build_preset
from kvxferd.layout.spec import KVCacheSpec, Layout

# CPU-sized defaults per preset; the caller's options come after them and win.
SMALL = {
    "dense": "num_blocks=16,num_layers=4,head_size=64,layout=HND",
    "mla": "num_blocks=8,num_layers=4",
    "hybrid": "num_blocks=4,attention_layers=2,mamba_layers=2",
}
HEADS_DEFAULT = {"dense": 8, "hybrid": 2}


def _name_opts(text: str) -> tuple[str, str]:
    name, _, opts = text.partition(":")
    name = name.strip()
    if name not in SMALL:
        raise ValueError(
            f"the TP scenario runs the presets {', '.join(SMALL)}, not {name!r}"
            " (add options after a colon, e.g. dense:layout=NHD)"
        )
    return name, opts


def total_kv_heads(text: str) -> int:
    """The model's KV heads for a preset text (0 for MLA): its ``num_kv_heads`` option, else
    the preset's default."""
    name, opts = _name_opts(text)
    if name not in HEADS_DEFAULT:
        return 0
    for item in opts.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "num_kv_heads":
            return int(value)
    return HEADS_DEFAULT[name]


def rank_spec(
    text: str, tp_size: int, *, shard_state: bool = False, options: str = ""
) -> KVCacheSpec:
    """The spec one rank of a ``tp_size``-way TP group registers for preset ``text``.

    ``shard_state``: divide each Mamba state's last dimension by the TP size (a state sharded
    across ranks, which kvxferd refuses under heterogeneous TP). ``options``: more
    ``key=value`` options for this side only (``ppl=34``)."""
    name, opts = _name_opts(text)
    opts = ",".join(o for o in (opts, options) if o)
    heads = total_kv_heads(text)
    full = f"{name}:{SMALL[name]},{opts}" if opts else f"{name}:{SMALL[name]}"
    extra: dict[str, object] = {}
    if heads:
        extra["num_kv_heads"] = kv_head_range(0, tp_size, heads)[1]
    spec = build_preset(full, **extra)
    if not shard_state or tp_size == 1:
        return spec
    regions = []
    for r in spec.regions:
        if r.layout is not Layout.STATE:
            regions.append(r)
            continue
        if r.shape[-1] % tp_size:
            raise ValueError(f"state {r.name} of shape {r.shape} does not split {tp_size} ways")
        regions.append(dataclasses.replace(r, shape=(*r.shape[:-1], r.shape[-1] // tp_size)))
    return dataclasses.replace(spec, regions=tuple(regions))


@dataclass(frozen=True)
class Request:
    """One request: logical block IDs per group on the prefill ranks and the decode ranks."""

    request_id: str
    remote_ids: tuple[tuple[int, ...], ...]
    local_ids: tuple[tuple[int, ...], ...]


def make_requests(
    prefill: KVCacheSpec, decode: KVCacheSpec, count: int, blocks: int, seed: int
) -> list[Request]:
    """``count`` requests of ``blocks`` prefill logical blocks (states) per group, on disjoint
    random IDs of each side. A decode token group whose ``ppl`` differs gets the logical blocks
    covering the same tokens (rounded up, as its engine would allocate them)."""
    rng = np.random.default_rng(seed)
    picks = []
    for side, spec in (("prefill", prefill), ("decode", decode)):
        per_group = []
        for g, group in enumerate(spec.groups):
            tokens = blocks * prefill.groups[g].ppl
            need = blocks if group.kind.is_state else -(-tokens // group.ppl)
            n = spec.num_logical_blocks(g)
            if count * need > n:
                raise ValueError(
                    f"{count} requests of {need} blocks need {count * need} blocks of the"
                    f" {side} group {group.name!r}, the pool has {n}; raise num_blocks"
                )
            per_group.append(rng.permutation(n)[: count * need].reshape(count, need))
        picks.append(per_group)
    return [
        Request(
            f"req-{j}",
            tuple(tuple(int(x) for x in g[j]) for g in picks[0]),
            tuple(tuple(int(x) for x in g[j]) for g in picks[1]),
        )
        for j in range(count)
    ]


def paired(prefill: KVCacheSpec, decode: KVCacheSpec, group: int, request: Request) -> int:
    """How many of the request's kernel blocks (states) of ``group`` a pull fills on the decode
    side: the tokens both sides hold (prefix caching off: both start at token 0)."""
    n_local = len(request.local_ids[group]) * decode.groups[group].ppl
    n_remote = len(request.remote_ids[group]) * prefill.groups[group].ppl
    return min(n_local, n_remote)


def kernel_ids(spec: KVCacheSpec, group: int, logical: tuple[int, ...]) -> list[int]:
    """Kernel block IDs of ``logical`` in ``group``; index ``k`` holds request block ``k``."""
    return [int(x) for x in expand_group(spec.groups[group], np.asarray(logical, np.int64))]


def pull_sets(
    prefill: KVCacheSpec,
    decodes: list[KVCacheSpec],
    remote_tp: int,
    request: Request,
) -> dict[int, tuple[int, ...]]:
    """Per decode rank, the prefill ranks it pulls ``request`` from (see the module doc)."""
    local_tp = len(decodes)
    reads: dict[int, set[int]] = {}
    for rank, spec in enumerate(decodes):
        plan = plan_pull(
            spec,
            prefill,
            list(request.local_ids),
            list(request.remote_ids),
            prefix_caching=False,
            local_tp=(rank, local_tp),
            remote_tp=(0, remote_tp),
        )
        reads[rank] = set(plan.per_rank)
    unread = set(range(remote_tp)).difference(*reads.values())
    return {
        rank: tuple(sorted(mine | {r for r in unread if r % local_tp == rank}))
        for rank, mine in reads.items()
    }
