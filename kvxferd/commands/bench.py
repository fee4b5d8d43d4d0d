"""``kvxferd bench``: raw copy, naive, the bare-NIXL floor and every strategy, one table.

For each request size (tokens) and block-ID pattern, on the dense Llama-3-8B-shaped layout
(32 layers, 64 KiB per block per layer), one run measures:

* **raw copy**: a raw copy of the same bytes (torch ``copy_``: host memory on CPU; device to
  device on GPU, across two GPUs when there are two), warmed up and repeated, the faster of
  one contiguous copy and one copy per layer, so that no row of the same run can beat it;
* **naive**: the vLLM connector's scheme, one NIXL descriptor per (layer, block), between two
  processes with raw NIXL agents (:mod:`kvxferd.scenario.naive`);
* **floor**: the descriptors a DIRECT pull posts (the naive ranges coalesced), posted as one
  READ by the same raw agents in a plain post/poll loop on the agent's NIXL thread: what NIXL
  itself costs, no daemon;
* **kvxferd**, one row per ``--strategy`` (``kernel``, ``direct``, ``staged``, ``auto``,
  ``cma``: ``kernel`` with the row named for what it runs on host memory): a prefill and a
  decode daemon (``kvxferd serve``); the time from ``StartPull`` to the terminal status,
  bytes from the status, after ``--warmup`` untimed pulls of the size (each of other blocks;
  the last timed pull is the one verified, so that no timed pull follows a Checksum); the row
  names what ran;

each with GB/s, x raw and x naive, and the transport it used (raw: the copy engine; naive and
floor: inferred from the floor's rate like the daemons' probe; kvxferd: the decode daemon's
``ListPeers`` ``read_transport``, the SM kernel for KERNEL, process_vm_readv for CMA). Then
the small-request latency (16 blocks) over many pulls through the daemons of the first
strategy. On GPU the bench sets ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` as the daemons do
(kvxferd.ipc.host) before its own agents start, so naive and floor run over what the daemons
run over. Every NIXL row uses the same
block IDs per (size, pattern, repeat) and is checked against the owner's bytes on a sample of
blocks. Exit 0: measured and verified; 1: a transfer failed or a sampled block differs; 2:
usage error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvxferd.commands import Subparsers, positive_int
from kvxferd.scenario import machine
from kvxferd.scenario.bench_cells import (
    CPU_SIZES,
    GPU_SIZES,
    SMALL_BLOCKS,
    Cell,
    make_workload,
    results_table,
    share_baselines,
)
from kvxferd.scenario.bench_daemons import floor_ms, latency_line, measure_daemons
from kvxferd.scenario.bench_local import measure_limit, measure_naive, nixl_transport
from kvxferd.scenario.client import RpcFailure
from kvxferd.scenario.daemons import DaemonError
from kvxferd.scenario.mix import PATTERNS
from kvxferd.scenario.puller import BenchFailure, say
from kvxferd.scenario.report import human_bytes, json_safe

_EXAMPLES = """\
examples:
  kvxferd bench                                   CPU, 256..8192 tokens, 3 repeats
  kvxferd bench --sizes 256,32768 --repeat 5 --json bench.json
  kvxferd bench --device cuda                     one GPU, or prefill cuda:0 -> decode cuda:1
  kvxferd bench --device cuda --sizes 256,8192 --strategy kernel,direct,staged,auto
                                                  one row per strategy beside raw, naive, floor
  kvxferd bench --sizes 16384 --strategy cma,direct   host memory: CMA vs DIRECT vs raw, floor
"""

WARMUP_PULLS = 3  # untimed pulls of each size through the daemons (--warmup), as raw
STAGED_STAGES = frozenset(("chunks", "gather", "gather_rpc", "read", "scatter", "slot_wait"))
STRATEGIES = ("auto", "direct", "staged", "kernel", "cma", "push")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token counts >= 1 (e.g. 256,4096)"
        )
    return sorted(set(sizes))


def _patterns(text: str) -> list[str]:
    pats = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in pats if p not in PATTERNS]
    if not pats or bad:
        raise argparse.ArgumentTypeError(
            f"unknown pattern(s) {bad or text!r}: use {','.join(PATTERNS)}"
        )
    return list(dict.fromkeys(pats))


def _strategies(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in STRATEGIES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of distinct strategies from"
            f" {','.join(STRATEGIES)} (e.g. kernel,direct,staged,auto)"
        )
    return names


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="raw copy limit vs one descriptor per (layer, block) vs kvxferd, in one table",
        description=(
            "Measure, for each request size and block-ID pattern, the raw copy limit of the"
            " same bytes, the naive one-descriptor-per-(layer, block) scheme through NIXL, and"
            " kvxferd through a prefill and a decode daemon, with ratios; then the small-request"
            " latency through the daemons. Prints the machine, versions and transports."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (host memory, default) or cuda (cuda:0 -> cuda:1 when there are two GPUs)",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        metavar="T,T,...",
        help=(
            "request sizes in tokens (16 per block); default"
            f" {','.join(map(str, CPU_SIZES))} on CPU, {','.join(map(str, GPU_SIZES))} on GPU"
        ),
    )
    p.add_argument(
        "--patterns",
        type=_patterns,
        default=list(PATTERNS),
        metavar="P,P",
        help="block-ID patterns: contiguous, fragmented (shuffled random IDs); default both",
    )
    p.add_argument(
        "--repeat", type=positive_int, default=3, metavar="N", help="runs per cell (median; 3)"
    )
    p.add_argument(
        "--warmup",
        type=positive_int,
        default=WARMUP_PULLS,
        metavar="N",
        help=(
            "untimed pulls of each size through the daemons before its timed ones (default"
            f" {WARMUP_PULLS}: a daemon's first pulls of a size run slower, docs/benchmarks.md)"
        ),
    )
    p.add_argument(
        "--latency-pulls",
        type=positive_int,
        default=50,
        metavar="N",
        help=f"small ({SMALL_BLOCKS}-block) pulls for the latency percentiles (default 50)",
    )
    p.add_argument(
        "--strategy",
        type=_strategies,
        default=["auto"],
        metavar="S,S",
        help=(
            "transfer.strategy of the decode daemon, one kvxferd row per value: auto (KERNEL"
            " or CMA where eligible, else the cost model picks), direct, staged, kernel; cma"
            " (kernel, named for host memory: process_vm_readv from a same-host owner); push"
            " runs both daemons in transfer.mode = push (the prefill daemon WRITEs); default"
            " auto. Each row shows what ran."
        ),
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="block-ID seed (default 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip filling the prefill pool and the sampled byte checks (faster on big CPU runs)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="keep the daemons' logs here (default: a temporary directory, removed on success)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    sizes: list[int] = args.sizes or list(CPU_SIZES if args.device == "cpu" else GPU_SIZES)
    workload = make_workload(args.device, sizes)
    ucx_note = ""
    if args.device == "cuda":
        # As the daemons do before their NIXL agents start, so naive and floor run over what
        # the daemons run over (the spawned owner process inherits the environment).
        from kvxferd.ipc.host import prepare_ucx_env

        note = prepare_ucx_env(workload.dev_prefill)
        ucx_note = (
            "set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: " if note.set_get_zcopy else ""
        ) + note.reason
    info, vers, env = machine.machine(), machine.versions(), machine.transports()
    spin = machine.busy_polling()
    base = [
        Cell(t, p, workload.blocks(t), workload.request_bytes(t), strategy=args.strategy[0])
        for t in sizes
        for p in args.patterns
    ]
    rows_by = {s: [c.for_strategy(s) for c in base] for s in args.strategy[1:]}
    rows_by[args.strategy[0]] = base
    cells = [c for s in args.strategy for c in rows_by[s]]
    pool_bytes = workload.shape.num_layers * workload.shape.layer_bytes
    header = [
        f"kvxferd bench: {workload.spec.model}-shaped KV cache ({workload.shape.num_layers} layers"
        f" x {human_bytes(workload.shape.block_bytes)} per block per layer, 16 tokens per"
        f" block), {workload.dev_prefill} -> {workload.dev_decode}, pools of"
        f" {workload.shape.num_blocks} blocks ({human_bytes(pool_bytes)}) per side,"
        f" median of {args.repeat}",
        *machine.describe(info, vers, env),
        *([f"ucx env:    {ucx_note}"] if ucx_note else []),
        f"daemons:    busy polling {'on' if spin['on'] else 'off'} ({spin['why']};"
        f" server.busy_poll, window {spin['window_ms']:g} ms)",
    ]
    for line in header:
        print(line, flush=True)
    workdir = args.log_dir
    temporary = workdir is None
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="kvxb-"))
    else:
        workdir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": "kvxferd " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "versions": vers,
        "transports": env,
        "busy_poll": spin,
        "device": args.device,
        "devices": {"prefill": workload.dev_prefill, "decode": workload.dev_decode},
        "layout": {
            "preset": "dense",
            "num_layers": workload.shape.num_layers,
            "block_bytes": workload.shape.block_bytes,
            "tokens_per_block": workload.spec.groups[0].kernel_block_size,
            "pool_blocks": workload.shape.num_blocks,
        },
        "repeat": args.repeat,
        "warmup": args.warmup,
        "seed": args.seed,
        "strategies": args.strategy,
        "ucx_env": ucx_note,
        "verified": not args.no_verify,
    }
    error = ""
    latency: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        say("raw copy limit ...")
        measure_limit(workload, base, args.repeat)
        say("naive: one NIXL descriptor per (layer, block), two processes ...")
        measure_naive(workload, base, args.repeat, args.seed, not args.no_verify)
        nixl_transport(workload, base)
        share_baselines(base, rows_by)
        for i, strategy in enumerate(args.strategy):
            say(f"kvxferd: prefill and decode daemons, transfer.strategy = {strategy} ...")
            (workdir / strategy).mkdir(parents=True, exist_ok=True)
            try:
                got = measure_daemons(
                    workload,
                    rows_by[strategy],
                    workdir / strategy,
                    repeat=args.repeat,
                    seed=args.seed,
                    verify=not args.no_verify,
                    strategy=strategy,
                    latency_pulls=args.latency_pulls if i == 0 else 0,
                    warmup=args.warmup,
                )
            except (BenchFailure, DaemonError, RpcFailure) as exc:
                # This strategy's rows say why; the other strategies are still measured.
                error = error or f"{strategy}: {exc}"
                for c in rows_by[strategy]:
                    c.failed = c.failed or str(exc)
                say(f"  {strategy} FAILED: {exc}")
                continue
            latency = latency or got
        # The raw copy once more, now that every other row ran (clocks and caches as warm as
        # theirs): the better pass is the raw copy, so no row of this run can beat it.
        say("raw copy limit, second pass ...")
        again = [Cell(b.tokens, b.pattern, b.blocks, b.nbytes) for b in base]
        measure_limit(workload, again, args.repeat)
        for b, a in zip(base, again, strict=True):
            if a.median("limit_gbps") > b.median("limit_gbps"):
                b.limit_gbps, b.limit_how = a.limit_gbps, a.limit_how
        share_baselines(base, rows_by)
    except (BenchFailure, DaemonError, RpcFailure) as exc:
        error = str(exc)
    except Exception as exc:  # NIXL, torch, the owner process: report, still print the table
        error = f"{type(exc).__name__}: {exc}"
    doc["wall_s"] = time.monotonic() - t0
    doc["rows"] = [c.doc() for c in cells]
    doc["latency"] = latency
    doc["error"] = error
    doc["ok"] = not error
    print("")
    print(results_table(cells, args.strategy))
    print(
        "\nraw copy: torch copy_ of the same bytes (the faster of one copy and one per layer);"
        " naive: one NIXL descriptor per (layer, block); floor: the descriptors DIRECT posts,"
        " one READ by a bare NIXL agent in a post/poll loop on its NIXL thread; kvxferd"
        " <strategy>: <what ran>:"
        " StartPull with wait to its answer (the terminal status) on the decode daemon's"
        " scheduler socket (server.scheduler_socket) through two daemons, after"
        f" {args.warmup} untimed pull{'s' if args.warmup > 1 else ''} of the size;"
        " x raw / x naive:"
        " the row's median over theirs; transport: what served the row (for NIXL rows inferred"
        " from a READ's rate: kvxferd.ipc.transport)"
    )
    for c in cells:
        med = {k: statistics.median(v) for k, v in c.stage_seconds.items()}
        own = [f"{k} {v * 1e3:.2f}" for k, v in med.items() if k not in STAGED_STAGES]
        if own:
            print(
                f"stages, {c.tokens} tokens {c.pattern} ({c.strategy}), median ms: "
                + ", ".join(own)
            )
        if "chunks" in med:
            print(
                f"STAGED stages, {c.tokens} tokens {c.pattern} ({c.strategy}): {med['chunks']:.0f}"
                f" chunks; summed over chunks (median): gather {med['gather'] * 1e3:.2f} ms,"
                f" gather RPC {med['gather_rpc'] * 1e3:.2f} ms, read {med['read'] * 1e3:.2f} ms,"
                f" scatter {med['scatter'] * 1e3:.2f} ms, slot wait"
                f" {med['slot_wait'] * 1e3:.2f} ms"
            )
    if latency:
        # The floor is a bare NIXL READ of DIRECT's descriptors: the daemons' added time is
        # measured against it for DIRECT pulls only (issue 14's target).
        floor = floor_ms(base, latency) if latency["strategy"] == "direct" else None
        if floor is not None:
            latency["floor_ms"] = floor
        print(
            f"small-request latency ({latency['blocks']} blocks = {latency['tokens']} tokens,"
            f" {human_bytes(latency['bytes'])}, {latency['pulls']} pulls each way, rotating):"
        )
        for how, fig in (
            ("StartPull + WatchTransfers (gRPC)", latency),
            ("StartPull with wait (gRPC)", latency["wait"]),
            ("StartPull with wait (scheduler socket)", latency["socket"]),
        ):
            print(latency_line(how, fig, floor))
        for how, rpc in (("gRPC", latency["rpc"]), ("scheduler socket", latency["socket_rpc"])):
            print(
                f"  control floor, {how}: one GetTransfer round trip to the decode daemon (the"
                f" same client, the same answer as StartPull with wait): p50"
                f" {rpc['p50_ms']:.2f} ms, p99 {rpc['p99_ms']:.2f} ms"
            )
        rel = latency["release"]
        print(
            f"  released after the pull (its status seen -> the release on the prefill"
            f" daemon's WatchReleases): p50 {rel['p50_ms']:.2f} ms, p99 {rel['p99_ms']:.2f} ms"
        )
    if latency.get("floor_ms") is not None:
        print(
            f"  floor: {latency['floor_ms']:.2f} ms, the time of the {latency['tokens']}-token"
            " fragmented row's floor (the same kind of descriptors, one READ by a bare NIXL"
            " agent); added = p50 or p99 minus it"
        )
    for strategy in args.strategy:
        failed = next((c.failed for c in rows_by[strategy] if c.failed), "")
        if failed:
            print(f"kvxferd {strategy} failed: {failed}")
    print(f"\nresult: {'OK' if not error else 'FAILED: ' + error}  (wall {doc['wall_s']:.1f}s)")
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(json_safe(doc), indent=2) + "\n")
        except OSError as exc:
            print(f"kvxferd: error: cannot write {args.json}: {exc}", file=sys.stderr)
            error = error or f"cannot write {args.json}"
    if error:
        print(f"daemon logs kept in {workdir}")
    elif temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not error else 1
