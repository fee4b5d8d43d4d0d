"""``kvxferd demo``: disaggregated KV transfer end to end on this machine, every block verified.

Starts a prefill daemon (pool filled with a deterministic pattern) and a decode daemon as
separate ``kvxferd serve`` processes on loopback, then plays the scheduler and the prefill
engine over the real gRPC API: per request, ``Hold`` on the prefill engine socket,
``StartPull`` on the decode daemon, the terminal state from one ``WatchTransfers`` stream,
then every pulled kernel block is verified with ``Checksum``: the decode block must now equal
the prefill block the planner pairs it with (:func:`kvxferd.blocks.plan_pull` on both
daemons' described specs) and must have changed from what it held before the pull.

A third and fourth daemon show one refusal: ``ppl`` differing with prefix caching on is refused
at the handshake (FAILED_PRECONDITION), and the daemon's explanation is printed.

Exit 0: every request DONE and verified, the refusal refused; 1: any mismatch or unexpected
failure; 2: usage error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvxferd.commands import Subparsers, positive_int
from kvxferd.scenario.client import DaemonClient, RpcFailure
from kvxferd.scenario.daemons import DaemonError, DaemonOptions, DaemonSet
from kvxferd.scenario.demo import Scenario
from kvxferd.scenario.demo_pairs import (
    DEFAULT_NUM_BLOCKS,
    MIN_NUM_BLOCKS,
    PRESET_NAMES,
    demo_pair,
    demonstrate_refusal,
    refusal_pair,
)
from kvxferd.scenario.demo_results import (
    RequestResult,
    busy_seconds,
    summarize,
    summary_table,
)
from kvxferd.scenario.mix import request_mix
from kvxferd.scenario.report import Progress, fmt, human_bytes, json_safe
from kvxferd.scenario.tp import run_tp

_EXAMPLES = """\
examples:
  kvxferd demo                          dense Llama-3-8B-shaped pools, 12 requests
  kvxferd demo --preset hybrid          attention + Mamba, ppl 34 (decode) vs 66 (prefill)
  kvxferd demo --requests 6 --num-blocks 64 --quiet --json demo.json
  kvxferd demo --tp 2:1 --preset mla    one daemon per TP rank: 2 prefill, 1 decode (docs/tp.md)
"""


def _num_blocks(text: str) -> int:
    n = positive_int(text)
    if n < MIN_NUM_BLOCKS:
        raise argparse.ArgumentTypeError(f"--num-blocks must be at least {MIN_NUM_BLOCKS}")
    return n


TP_PRESETS = ("dense", "mla", "hybrid")


def _tp_shape(text: str) -> tuple[int, int]:
    p, sep, d = text.partition(":")
    try:
        shape = (positive_int(p), positive_int(d)) if sep else None
    except argparse.ArgumentTypeError:
        shape = None
    if shape is None or max(shape) % min(shape):
        raise argparse.ArgumentTypeError(
            f"--tp {text!r}: give prefill:decode TP sizes where one divides the other, e.g. 2:1"
        )
    return shape


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="run a prefill and a decode daemon and verify every pulled block",
        description=(
            "Start a prefill and a decode daemon on loopback (owned pools in host memory by"
            " default), hold and pull a mix of requests over the real gRPC API (short and long"
            " prompts, contiguous and fragmented block IDs, prefix-cache hits including a full"
            " hit; for the hybrid preset different ppl on the two sides), verify every pulled"
            " kernel block with Checksum, and show one refused pair (ppl differing with prefix"
            " caching on). Exit 0: all verified; 1: a mismatch or unexpected failure."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default="dense",
        help="model shape of both pools (default dense: Llama-3-8B-like)",
    )
    p.add_argument(
        "--requests", type=positive_int, default=12, metavar="N", help="requests (default 12)"
    )
    p.add_argument(
        "--num-blocks",
        type=_num_blocks,
        default=None,
        metavar="N",
        help=(
            "logical blocks per KV cache group of the prefill pool; the decode pool holds as"
            " many tokens (default: dense 256 = 512 MiB, hybrid 32, mla 64, fp8 256)"
        ),
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="request mix seed (default 0)")
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        metavar="C",
        help="requests in flight at once (default 1: latencies without queueing)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="pool memory: cpu (DRAM, default) or cuda (prefill cuda:0, decode cuda:1 if present)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output (summary only)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON")
    p.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="keep the daemons' logs, sockets and ready files here (default: a temporary"
        " directory, removed unless the demo fails)",
    )
    p.add_argument(
        "--engine",
        choices=("none", "vllm"),
        default="none",
        help="none (default): the demo plays the engines; vllm: real vLLM engines with"
        " kvxferd's connector beside vLLM's NixlConnector (docs/vllm.md)",
    )
    p.add_argument(
        "--tp",
        type=_tp_shape,
        metavar="P:D",
        help="one daemon per TP rank, P prefill and D decode (e.g. 2:1, 1:2, 4:1; presets"
        f" {', '.join(TP_PRESETS)}): every decode rank pulls from the prefill ranks holding its"
        " heads, every pulled block of every rank verified by Checksum (docs/tp.md)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds to wait for the daemons to start (default 120)",
    )
    return p


# ---- run ----------------------------------------------------------------------------------


def _describe_side(client: DaemonClient, options: DaemonOptions) -> dict[str, Any]:
    info = client.describe()
    return {
        "preset": options.preset,
        "device": options.device,
        "prefix_caching": options.prefix_caching,
        "grpc": client.grpc_address,
        "peer_address": info.peer_address,
        "nixl_agent": info.nixl_agent_name,
        "pool_bytes": sum(r.nbytes for r in info.registrations),
        "held_requests": info.held_requests,
    }


def run(args: argparse.Namespace) -> int:
    if getattr(args, "engine", "none") == "vllm":
        from kvxferd.commands import demo_vllm

        return demo_vllm.run(args)
    if getattr(args, "tp", None) is not None:
        return _run_tp(args)
    num_blocks: int = args.num_blocks or DEFAULT_NUM_BLOCKS[args.preset]
    pair = demo_pair(args.preset, num_blocks, device=args.device, seed=args.seed)
    refusal = refusal_pair()
    out = sys.stdout
    progress = Progress.auto(args.requests, quiet=args.quiet)
    workdir = args.log_dir
    temporary = workdir is None
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="kvxd-"))
    else:
        workdir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "requests_asked": args.requests,
        "preset": args.preset,
        "device": args.device,
        "num_blocks": num_blocks,
        "prefix_caching": pair.prefix_caching,
        "seed": args.seed,
        "concurrency": args.concurrency,
    }
    errors: list[str] = []
    results: list[RequestResult] = []
    busy_s = 0.0
    daemons = DaemonSet(workdir, [pair.prefill, pair.decode, refusal.prefill, refusal.decode])
    print(
        f"kvxferd demo: preset {args.preset}, {args.requests} requests, prefix caching"
        f" {'on' if pair.prefix_caching else 'off'}, pools in"
        f" {'host memory' if args.device == 'cpu' else 'GPU memory'}",
        file=out,
        flush=True,
    )
    t_start = time.monotonic()
    clients: list[DaemonClient] = []
    scenario: Scenario | None = None
    try:
        with daemons:
            daemons.start()
            progress.message(f"starting 4 daemons (logs in {workdir}) ...")
            daemons.wait_ready(args.ready_timeout)
            doc["startup_s"] = time.monotonic() - t_start
            ready = {d.name: d.ready for d in daemons}
            for name in ("prefill", "decode", "refused-prefill", "refused-decode"):
                info = ready[name]
                assert info is not None
                clients.append(DaemonClient(name, info.grpc, info.engine_socket))
            prefill, decode, r_prefill, r_decode = clients
            doc["daemons"] = {
                "prefill": _describe_side(prefill, pair.prefill),
                "decode": _describe_side(decode, pair.decode),
            }
            for side in ("prefill", "decode"):
                d = doc["daemons"][side]
                print(
                    f"  {side:<8} {d['preset']:<28} {d['device']:<7} pool"
                    f" {human_bytes(d['pool_bytes']):>10}  grpc {d['grpc']}",
                    file=out,
                    flush=True,
                )
            scenario = Scenario(
                prefill,
                decode,
                pair,
                seed=args.seed,
                concurrency=args.concurrency,
                progress=progress,
                check_alive=daemons.check_alive,
            )
            shapes = request_mix(
                args.requests,
                local=scenario.local_geo,
                remote=scenario.remote_geo,
                prefix_caching=pair.prefix_caching,
                seed=args.seed,
            )
            scenario.run(shapes)
            doc["held_after"] = prefill.describe().held_requests
            doc["refusal"] = demonstrate_refusal(r_prefill, r_decode)
            daemons.check_alive()
    except DaemonError as exc:
        progress.finish()
        errors.append(str(exc))
    except RpcFailure as exc:
        progress.finish()
        errors.append(f"unexpected: {exc}")
    finally:
        for c in clients:
            c.close()
    if scenario is not None:
        results = scenario.results
        errors.extend(scenario.errors)
        busy_s = busy_seconds([(r.started_at, r.ended_at) for r in results if r.state == "DONE"])
    errors.extend(daemons.stop_problems())
    doc["wall_s"] = time.monotonic() - t_start
    doc.update(summarize(results, busy_s))
    refused = doc.get("refusal")
    if refused is not None and refused.get("error"):
        errors.append(f"refusal demonstration: {refused['error']}")
    if refused is None and not errors:
        errors.append("the refusal was not demonstrated")
    for r in results:
        errors.extend(f"request {r.index + 1} ({r.kind}, {r.pattern}): {e}" for e in r.errors)
    if doc["requested_blocks"] != doc["verified_blocks"] and not errors:
        errors.append(
            f"verified {doc['verified_blocks']} of {doc['requested_blocks']} pulled kernel blocks"
        )
    doc["failures"] = len(errors)
    doc["errors"] = errors
    doc["ok"] = not errors
    doc["per_request"] = [asdict(r) | {"ok": r.ok} for r in results]
    _print_summary(doc, results, out)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(json_safe(doc), indent=2) + "\n")
        except OSError as exc:
            print(f"kvxferd: error: cannot write {args.json}: {exc}", file=sys.stderr)
            errors.append(f"cannot write {args.json}")
    if errors and temporary:
        print(f"daemon logs kept in {workdir}", file=out)
    elif temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not errors else 1


def _run_tp(args: argparse.Namespace) -> int:
    p, d = args.tp
    if args.preset not in TP_PRESETS:
        print(
            f"kvxferd demo: error: --tp runs the presets {', '.join(TP_PRESETS)}, not"
            f" {args.preset!r}",
            file=sys.stderr,
        )
        return 2
    print(
        f"kvxferd demo: TP {p}:{d}, preset {args.preset}, {args.requests} requests, pools in"
        f" {'host memory' if args.device == 'cpu' else 'GPU memory'}: starting {p + d} daemons"
        " (one per rank) ...",
        flush=True,
    )
    try:
        report = run_tp(
            p, d, args.preset, requests=args.requests, seed=args.seed, device=args.device
        )
    except DaemonError as exc:
        print(f"kvxferd demo: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # the scenario's pools cannot hold this many requests
        print(f"kvxferd demo: error: {exc} (with --tp: ask for fewer --requests)", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    print(f"result: {'OK' if report.ok else 'FAILED'}")
    if args.json:
        args.json.write_text(json.dumps(json_safe(report.to_dict()), indent=2) + "\n")
    return 0 if report.ok else 1


def _print_summary(doc: dict[str, Any], results: list[RequestResult], out: Any) -> None:
    if results:
        print("", file=out)
        print(summary_table(results), file=out)
        lat = doc["latency_ms"]
        print(
            f"\n{doc['requests_done']}/{doc['requests']} requests DONE,"
            f" {doc['verified_blocks']}/{doc['requested_blocks']} pulled kernel blocks verified"
            f" ({doc['changed_blocks']} changed by the pull),"
            f" {human_bytes(doc['bytes'])} in {doc['busy_s']:.2f}s of transfers ="
            f" {fmt(doc['throughput_gbps'])} GB/s; latency p50/p90/p99"
            f" {fmt(lat['p50'])}/{fmt(lat['p90'])}/{fmt(lat['p99'])} ms (StartPull to terminal"
            f" state on WatchTransfers); descriptors {doc['descriptors']['naive']:,} naive ->"
            f" {doc['descriptors']['posted']:,} posted",
            file=out,
        )
        if doc["preloaded_blocks"]:
            print(
                f"note: {doc['preloaded_blocks']} decode blocks already held the expected bytes"
                " before their pull (reused blocks); their write is not proven by a change",
                file=out,
            )
        if doc["ambiguous_blocks"]:
            print(
                f"note: {doc['ambiguous_blocks']} pulled blocks share their digest with another"
                " block of the same request (the fill pattern repeats), so a swap among them"
                " would not be detected",
                file=out,
            )
    refusal = doc.get("refusal")
    if refusal is not None:
        print(
            "\nrefusal (expected): decode hybrid:ppl=34 --prefix-caching pulling from"
            " prefill hybrid:ppl=66 --prefix-caching",
            file=out,
        )
        for line in refusal.get("explanation") or [f"{refusal['code']}: {refusal['message']}"]:
            print(
                textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="      "), file=out
            )
    verdict = "OK" if doc["ok"] else f"FAILED ({doc['failures']} problems)"
    print(f"\nresult: {verdict}  (wall {doc['wall_s']:.1f}s)", file=out)
    for e in doc["errors"]:
        print(f"  - {e}", file=out)
