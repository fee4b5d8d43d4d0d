"""``kvxferd plan``: check two specs for compatibility and show the byte ranges a pull reads.

Offline, no daemon or GPU: the same :func:`~kvxferd.peers.check_compatible` the handshake runs
and the same :func:`~kvxferd.blocks.plan_pull` a transfer runs, on two specs and one request's
logical block IDs. One report (a plain dict) is built, then printed as text or as one JSON
document. Exit 0: compatible and planned; 1: incompatible or the request is invalid; 2: usage.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import numpy as np

from kvxferd.blocks import PullPlan, RegionRanges, plan_pull
from kvxferd.blocks.ranges import Int64Array
from kvxferd.commands import Subparsers, block_ids_arg, spec_arg, tp_arg
from kvxferd.errors import KvxferdError
from kvxferd.layout import KVCacheSpec
from kvxferd.peers import PeerInfo, check_compatible

Doc = dict[str, Any]

_EXAMPLES = """\
examples:
  kvxferd plan --local hybrid:ppl=66 --remote hybrid:ppl=34 \\
      --local-ids "0,1;0" --remote-ids "5,6;2"
  kvxferd plan --local dense:layout=HND,num_kv_heads=4 --local-tp 1/2 \\
      --remote dense:layout=HND --local-ids 0-3 --remote-ids 10-13 --json
"""


def _count_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return n


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="check two KV cache specs and show the byte ranges one pull would read",
        description=(
            "Check a local (decode, reader) and a remote (prefill) KV cache spec for"
            " compatibility, listing every mismatch with its fix; if compatible, plan the pull"
            " of one request's blocks and print its byte ranges per remote rank and region."
            " Exit 0: planned; 1: incompatible or invalid request; 2: usage error."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec_help = "a TOML spec file or a preset such as dense or hybrid:ppl=34,num_blocks=64"
    p.add_argument("--local", required=True, type=spec_arg, metavar="SPEC", help=spec_help)
    p.add_argument("--remote", required=True, type=spec_arg, metavar="SPEC", help=spec_help)
    ids_help = "logical block IDs per group in spec order, groups split by ';', e.g. '0-9;3,4'"
    p.add_argument("--local-ids", required=True, type=block_ids_arg, metavar="IDS", help=ids_help)
    p.add_argument("--remote-ids", required=True, type=block_ids_arg, metavar="IDS", help=ids_help)
    p.add_argument(
        "--prefix-caching", action="store_true", help="prefix caching is on (on both sides)"
    )
    tp_help = "tensor-parallel rank and size of that side (default 0/1)"
    p.add_argument("--local-tp", type=tp_arg, default=(0, 1), metavar="RANK/SIZE", help=tp_help)
    p.add_argument("--remote-tp", type=tp_arg, default=(0, 1), metavar="RANK/SIZE", help=tp_help)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument(
        "--max-ranges",
        type=_count_arg,
        default=8,
        metavar="N",
        help="text output: byte ranges (and kernel-ID runs) shown per region (default 8)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    local_spec: KVCacheSpec = args.local
    remote_spec: KVCacheSpec = args.remote
    prefix: bool = args.prefix_caching
    peers = [
        PeerInfo(spec=spec, tp_rank=tp[0], tp_size=tp[1], prefix_caching=prefix, name=name)
        for spec, tp, name in (
            (local_spec, args.local_tp, "local"),
            (remote_spec, args.remote_tp, "remote"),
        )
    ]
    report = check_compatible(peers[0], peers[1])
    doc: Doc = {
        "local": _side_doc(peers[0]),
        "remote": _side_doc(peers[1]),
        "prefix_caching": prefix,
        "compatible": report.compatible,
        "tp_ratio": report.tp_ratio,
        "mismatches": [
            {"what": m.what, "local": m.local, "remote": m.remote, "fix": m.fix} for m in report
        ],
        "error": None,
        "plan": None,
    }
    refused: KvxferdError | None = None
    if report.compatible:
        try:
            plan = plan_pull(
                local_spec,
                remote_spec,
                args.local_ids,
                args.remote_ids,
                prefix_caching=prefix,
                local_tp=args.local_tp,
                remote_tp=args.remote_tp,
            )
        except KvxferdError as exc:
            refused = exc
            doc["error"] = {
                "type": type(exc).__name__,
                "field": exc.field,
                "message": exc.message,
                "fix": exc.fix,
            }
        else:
            doc["plan"] = _plan_doc(plan, local_spec, remote_spec)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(_text(doc, args.max_ranges)))
        if refused is not None:
            print(f"kvxferd: error: {refused}", file=sys.stderr)
    return 0 if doc["plan"] is not None else 1


# ---- the report -------------------------------------------------------------------------


def _side_doc(peer: PeerInfo) -> Doc:
    spec = peer.spec
    return {
        "model": spec.model,
        "tp": {"rank": peer.tp_rank, "size": peer.tp_size},
        "regions": len(spec.regions),
        "bytes": spec.nbytes,
        "groups": [
            {
                "name": g.name,
                "kind": g.kind.value,
                "ppl": g.ppl,
                "logical_blocks": spec.num_logical_blocks(i),
                "kernel_blocks": spec.num_kernel_blocks(i),
            }
            for i, g in enumerate(spec.groups)
        ],
        "describe": spec.describe(),
    }


def _plan_doc(plan: PullPlan, local: KVCacheSpec, remote: KVCacheSpec) -> Doc:
    ranks = [
        {
            "remote_rank": r,
            "bytes": tp.nbytes,
            "descriptors": tp.num_ranges,
            "naive_descriptors": tp.naive_descriptors,
            "regions": _collapse(tp.ranges),
        }
        for r, tp in sorted(plan.per_rank.items())
    ]
    groups = [
        {
            "group": g,
            "name": local.groups[g].name,
            "kind": local.groups[g].kind.value,
            "local_ppl": local.groups[g].ppl,
            "remote_ppl": remote.groups[g].ppl,
            "blocks": int(lk.shape[0]),
            "local_kernel_ids": lk.tolist(),
            "remote_kernel_ids": rk.tolist(),
        }
        for g, (lk, rk) in enumerate(
            zip(plan.local_kernel_blocks, plan.remote_kernel_blocks, strict=True)
        )
    ]
    return {
        "tp_ratio": plan.tp_ratio,
        "read_ranks": list(plan.read_ranks),
        "notify_ranks": list(plan.notify_ranks),
        "totals": {
            "bytes": plan.nbytes,
            "descriptors": plan.num_ranges,
            "naive_descriptors": plan.naive_descriptors,
        },
        "ranks": ranks,
        "groups": groups,
    }


def _collapse(ranges: tuple[RegionRanges, ...]) -> list[Doc]:
    """Regions with identical ranges (typically every layer) as one entry, first-seen order;
    regions not read from this rank are left out."""
    by_key: dict[tuple[bytes, bytes, bytes], list[RegionRanges]] = {}
    for rg in ranges:
        if rg.num_ranges:
            key = (rg.local_offset.tobytes(), rg.remote_offset.tobytes(), rg.length.tobytes())
            by_key.setdefault(key, []).append(rg)
    out = []
    for same in by_key.values():
        first = same[0]
        names = [rg.name for rg in same]
        out.append(
            {
                "label": _label(names),
                "regions": names,
                "count": len(same),
                "bytes_per_region": first.nbytes,
                "ranges_per_region": first.num_ranges,
                "ranges": np.stack(
                    (first.local_offset, first.remote_offset, first.length), axis=1
                ).tolist(),
            }
        )
    return out


_NUM = re.compile(r"\d+")


def _label(names: list[str]) -> str:
    """``layer.0..layer.31`` for a run of names differing in one number, ``mamba.{0..3,5}.ssm``
    for a gapped one, else the names themselves (shortened past four)."""
    if len(names) == 1:
        return names[0]
    texts = {tuple(_NUM.split(n)) for n in names}
    nums = [_NUM.findall(n) for n in names]
    varying = [i for i in range(len(nums[0])) if len({n[i] for n in nums}) > 1]
    if len(texts) == 1 and len(varying) == 1:
        vals = [int(n[varying[0]]) for n in nums]
        if vals == list(range(vals[0], vals[0] + len(vals))):
            return f"{names[0]}..{names[-1]}"
        if vals == sorted(set(vals)):
            span = list(_NUM.finditer(names[0]))[varying[0]].span()
            runs = ",".join(f"{a}..{b}" if a != b else str(a) for a, b in _runs(vals))
            return f"{names[0][: span[0]]}{{{runs}}}{names[0][span[1] :]}"
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"


def _runs(vals: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for v in vals:
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


# ---- text -------------------------------------------------------------------------------


def _text(doc: Doc, max_ranges: int) -> list[str]:
    lines = []
    for side in ("local", "remote"):
        s = doc[side]
        lines.append(f"{side:<6}  TP {s['tp']['rank']}/{s['tp']['size']}  {s['describe']}")
    lines.append(f"prefix caching {'on' if doc['prefix_caching'] else 'off'}")
    if not doc["compatible"]:
        n = len(doc["mismatches"])
        lines.append(f"verdict: INCOMPATIBLE, {n} mismatch{'es' if n != 1 else ''}")
        for m in doc["mismatches"]:
            lines.append(f"  - {m['what']}: local {m['local']}, remote {m['remote']}")
            lines.append(f"    fix: {m['fix']}")
        return lines
    lines.append(f"verdict: compatible (TP ratio {doc['tp_ratio']})")
    plan = doc["plan"]
    if plan is None:
        lines.append("plan: refused, the request is invalid (see the error)")
        return lines
    reads = ", ".join(map(str, plan["read_ranks"])) or "none"
    notify = ", ".join(map(str, plan["notify_ranks"]))
    lines.append(f"plan: read from remote rank(s) {reads}; notify remote rank(s) {notify}")
    for rank in plan["ranks"]:
        lines.append(
            f"remote rank {rank['remote_rank']}: {_bytes(rank['bytes'])},"
            f" {rank['descriptors']} descriptors (naive {rank['naive_descriptors']})"
        )
        if not rank["regions"]:
            lines.append("  nothing to read (full prefix hit); notify only")
        for entry in rank["regions"]:
            lines.extend(_region_lines(entry, max_ranges))
    lines.append("kernel blocks per group (local <- remote):")
    for g in plan["groups"]:
        n = g["blocks"]
        pairs = _pair_runs(g["local_kernel_ids"], g["remote_kernel_ids"], max_ranges)
        lines.append(
            f"  #{g['group']} {g['name']} ({g['kind']}, ppl local {g['local_ppl']}, remote"
            f" {g['remote_ppl']}): {n} block{'s' if n != 1 else ''}{': ' if n else ''}{pairs}"
        )
    t = plan["totals"]
    lines.append(
        f"total: {_bytes(t['bytes'])}, {t['descriptors']} descriptors after coalescing,"
        f" {t['naive_descriptors']} naive"
    )
    return lines


def _region_lines(entry: Doc, max_ranges: int) -> list[str]:
    n, count = entry["ranges_per_region"], entry["count"]
    what = f"{entry['label']} ({count} region{'s' if count != 1 else ''})"
    each = " each" if count != 1 else ""
    out = [f"  {what}: {n} range{'s' if n != 1 else ''}, {entry['bytes_per_region']} bytes{each}"]
    rows = [("local_offset", "remote_offset", "length")]
    rows += [(str(a), str(b), str(c)) for a, b, c in entry["ranges"][:max_ranges]]
    if max_ranges:
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        out += [
            "      " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows
        ]
    if n > max_ranges:
        out.append(f"      ... {n - max_ranges} more")
    return out


def _pair_runs(local: list[int], remote: list[int], max_runs: int) -> str:
    lk, rk = np.asarray(local, dtype=np.int64), np.asarray(remote, dtype=np.int64)
    if not lk.shape[0]:
        return ""
    brk = np.flatnonzero((np.diff(lk) != 1) | (np.diff(rk) != 1)) + 1
    starts: Int64Array = np.concatenate(([0], brk)).astype(np.int64)
    ends: Int64Array = np.concatenate((brk, [lk.shape[0]])).astype(np.int64)
    parts = [
        f"{_span(int(lk[s]), int(lk[e - 1]))} <- {_span(int(rk[s]), int(rk[e - 1]))}"
        for s, e in zip(starts[:max_runs].tolist(), ends[:max_runs].tolist(), strict=True)
    ]
    more = starts.shape[0] - len(parts)
    return ", ".join(parts) + (f", ... {more} more run{'s' if more != 1 else ''}" if more else "")


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}..{b}"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} bytes ({n / size:.1f} {unit})"
    return f"{n} bytes"
