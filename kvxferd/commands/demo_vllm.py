"""``kvxferd demo --engine vllm``: real vLLM engines disaggregated through kvxferd, beside vLLM's
own NixlConnector on the same prompts.

Phases, one after the other so that idle engines do not share the two cores with measured ones:

1. **single**: one vLLM engine, no connector: every prompt's greedy reference tokens and TTFT.
2. **kvxferd**: two ``kvxferd serve`` daemons in attached mode, a prefill and a decode vLLM
   engine each loading :class:`kvxferd.vllm.connector.KvxferdConnector` with its daemon's
   Engine socket. This process plays vLLM's disaggregated proxy: the prompt goes to prefill with
   ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, what prefill returns
   goes unchanged to decode with the real ``max_tokens``. The decode daemon's transfers are
   watched (``WatchTransfers``) to show how many blocks moved; a prompt that extends an
   earlier one shows a prefix-cache hit moving only the missing blocks.
3. **nixl**: the same with vLLM's NixlConnector (``kv_producer`` / ``kv_consumer``,
   ``kv_buffer_device=cpu``), no daemons.

Per prompt it prints whether decode's greedy tokens equal the single engine's, and the decode
TTFT with each connector. The **control**: decode gets prompt B (different tokens, same length
and last token as A) with A's ``kv_transfer_params``; only an engine that used the pulled KV
reproduces A's output (B alone gives other tokens with these random weights). Finally the
prefill daemon must hold nothing and no shared-memory segment of the run may be left. Two
failure paths are shown too: a ticket held on an incompatible daemon (decode refuses it and
vLLM's ``kv_load_failure_policy`` ends the request), and a decode request aborted before its
pull (the decode connector declines the prefill's hold, which is released at once).

The model is a tiny Llama with random weights written locally (:mod:`kvxferd.vllm.tiny_model`):
nothing is downloaded. Needs vLLM importable by this Python (docs/vllm.md says how to install).
Exit 0: every prompt identical with kvxferd, the control passed, nothing left; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvxferd.errors import KvxferdError
from kvxferd.scenario.client import state_name
from kvxferd.scenario.daemons import DaemonError, DaemonOptions, DaemonSet
from kvxferd.scenario.ports import free_ports
from kvxferd.scenario.vllm_engines import (
    BLOCK_SIZE,
    DAEMON_EXTRA,
    ENGINE_START_S,
    MAX_TOKENS,
    EngineProc,
    binds,
    demo_prompts,
    engine_args,
    engine_env,
    prompt_tokens,
)
from kvxferd.scenario.vllm_pair import (
    Row,
    TransferLog,
    check_vllm,
    held_requests,
    nixl_installed,
    pool_block_bytes,
    run_pair,
    shm_leftovers,
)
from kvxferd.scenario.vllm_report import report

# How long the demo waits for an aborted decode request's hold to be released (its lease's TTL
# is transfer.lease_ttl_ms, 60 s by default).
ABORT_WAIT_S = 20.0


def run(args: argparse.Namespace) -> int:
    check_vllm()
    out = sys.stdout
    quiet = bool(getattr(args, "quiet", False))

    def say(text: str) -> None:
        if not quiet:
            print(text, file=out, flush=True)

    workdir = args.log_dir
    temporary = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="kvxd-vllm-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    from kvxferd.vllm.tiny_model import write_tiny_llama

    model = write_tiny_llama(workdir / "tiny-llama", seed=args.seed)
    prompts, ctl_a, ctl_b = demo_prompts()
    bind_p, bind_d = binds()
    print(
        f"kvxferd demo --engine vllm: tiny Llama (2 layers, random weights) on CPU, {len(prompts)}"
        f" prompts of {min(len(p.tokens) for p in prompts)}-{max(len(p.tokens) for p in prompts)}"
        f" tokens + a control, greedy, {MAX_TOKENS} tokens each; logs in {workdir}",
        file=out,
        flush=True,
    )
    doc: dict[str, Any] = {"engine": "vllm", "block_size": BLOCK_SIZE, "max_tokens": MAX_TOKENS}
    t_all = time.monotonic()
    errors: list[str] = []
    engines: list[EngineProc] = []
    try:
        # 1. single engine: the reference
        single = EngineProc(
            "single", workdir, engine_args(model, "none", "single"), engine_env(bind_p)
        )
        engines.append(single)
        single.wait_ready(ENGINE_START_S)
        say(f"  single engine ready in {single.startup_s:.1f} s")
        ref_out = single.generate(
            [
                {"id": p.name, "tokens": list(p.tokens), "max_tokens": MAX_TOKENS}
                for p in [*prompts, ctl_a, ctl_b]
            ]
        )
        ref = {o["id"]: list(o["tokens"]) for o in ref_out}
        single.stop()
        engines.remove(single)
        doc["single_startup_s"] = single.startup_s

        # 2. kvxferd pair
        daemons = DaemonSet(
            workdir,
            [
                DaemonOptions(
                    "prefill", "dense:num_blocks=16", prefix_caching=True, extra=DAEMON_EXTRA
                ),
                DaemonOptions(
                    "decode",
                    "dense:num_blocks=16",
                    prefix_caching=True,
                    extra=DAEMON_EXTRA,
                    scheduler_socket=True,
                ),
                # An owned Llama-3-8B-shaped pool: a peer the decode daemon must refuse.
                DaemonOptions(
                    "stranger",
                    "dense:num_blocks=16",
                    prefix_caching=True,
                    extra=("--set", "transfer.staging_chunks=0", "--set", "log.format=text"),
                ),
            ],
        )
        with daemons:
            daemons.start()
            daemons.wait_ready(args.ready_timeout)
            rp, rd = daemons["prefill"].ready, daemons["decode"].ready
            assert rp is not None and rd is not None
            t0 = time.monotonic()
            kp = EngineProc(
                "kvxferd-prefill",
                workdir,
                engine_args(model, "kvxferd", "prefill", rp.engine_socket),
                engine_env(bind_p),
            )
            kd = EngineProc(
                "kvxferd-decode",
                workdir,
                engine_args(model, "kvxferd", "decode", rd.engine_socket),
                engine_env(bind_d),
            )
            engines += [kp, kd]
            kp.wait_ready(ENGINE_START_S)
            kd.wait_ready(ENGINE_START_S)
            doc["kvxferd_startup_s"] = time.monotonic() - t0
            say(
                f"  kvxferd pair ready in {doc['kvxferd_startup_s']:.1f} s (daemons {rp.grpc},"
                f" {rd.grpc})"
            )
            block_bytes = pool_block_bytes(rd.engine_socket)
            transfers = TransferLog(rd.grpc)
            try:
                k_rows, k_ctl = run_pair(
                    "kvxferd",
                    kp,
                    decode=kd,
                    prompts=prompts,
                    control=(ctl_a, ctl_b),
                    transfers=transfers,
                    block_bytes=block_bytes,
                    say=say,
                )
                doc["refusal"] = refusal(kd, daemons["stranger"], transfers, say)
                doc["aborted"] = aborted(kp, kd, rp.engine_socket, say)
            finally:
                transfers.close()
            held_deadline = time.monotonic() + 15
            held = held_requests(rp.engine_socket)
            while held and time.monotonic() < held_deadline:
                time.sleep(0.2)
                held = held_requests(rp.engine_socket)
            doc["held_after_run"] = held
            for e in (kp, kd):
                e.stop()
                engines.remove(e)
            tags = [f"kvxferd-vllm-{e.proc.pid}-" for e in (kp, kd)]
        errors += daemons.stop_problems()
        doc["shm_left"] = shm_leftovers(tags)

        # 3. NixlConnector pair
        n_rows: dict[str, Row] = {}
        n_ctl: Row | None = None
        if nixl_installed():
            port_p, port_d = free_ports(2)
            np_env = engine_env(
                bind_p,
                {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port_p),
                },
            )
            nd_env = engine_env(
                bind_d,
                {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port_d),
                },
            )
            t0 = time.monotonic()
            npf = EngineProc("nixl-prefill", workdir, engine_args(model, "nixl", "prefill"), np_env)
            ndc = EngineProc("nixl-decode", workdir, engine_args(model, "nixl", "decode"), nd_env)
            engines += [npf, ndc]
            npf.wait_ready(ENGINE_START_S)
            ndc.wait_ready(ENGINE_START_S)
            doc["nixl_startup_s"] = time.monotonic() - t0
            say(f"  NixlConnector pair ready in {doc['nixl_startup_s']:.1f} s")
            n_rows, n_ctl = run_pair(
                "nixl",
                npf,
                decode=ndc,
                prompts=prompts,
                control=(ctl_a, ctl_b),
                transfers=None,
                block_bytes=0,
                say=say,
            )
            for e in (npf, ndc):
                e.stop()
                engines.remove(e)
        else:
            say(
                "  NixlConnector comparison skipped: the 'nixl' package (pip install nixl==1.5.1)"
                " is not installed"
            )
    except (KvxferdError, DaemonError) as exc:
        for e in engines:
            e.stop()
        print(f"kvxferd demo --engine vllm: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for e in engines:
            e.stop()

    report(
        doc,
        errors,
        out,
        prompts=prompts,
        control=(ctl_a, ctl_b),
        ref=ref,
        kvxferd=(k_rows, k_ctl),
        nixl=(n_rows, n_ctl),
        started=t_all,
    )
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    for err in errors:
        print(f"FAILED: {err}", file=sys.stderr)
    print(f"{'OK' if not errors else 'FAILED'} in {doc['total_s']:.0f} s", file=out)
    if temporary and not errors:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not errors else 1


def aborted(
    prefill: EngineProc, decode: EngineProc, prefill_socket: str, say: Any
) -> dict[str, Any]:
    """A decode request aborted before its pull: the decode connector declines the prefill's
    hold (DeclinePull), so the prefill daemon releases it long before its lease's TTL."""
    deadline = time.monotonic() + ABORT_WAIT_S
    while held_requests(prefill_socket) and time.monotonic() < deadline:
        time.sleep(0.1)  # the earlier pulls' holds are released once their reads are reported
    out = prefill.generate(
        [
            {
                "id": "aborted",
                "tokens": prompt_tokens(80, 13),
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            }
        ]
    )[0]
    params = out.get("kv_transfer_params") or {}
    held_before = held_requests(prefill_socket)  # the pulls before it released theirs
    t0 = time.monotonic()
    decode.abort(
        [
            {
                "id": "aborted",
                "tokens": prompt_tokens(80, 13),
                "max_tokens": 4,
                "kv_transfer_params": params,
            }
        ]
    )
    held = held_before
    while held and time.monotonic() - t0 < ABORT_WAIT_S:
        time.sleep(0.1)
        held = held_requests(prefill_socket)
    seconds = time.monotonic() - t0
    result = {
        "ticket": "kvxferd" in params,
        "held_before": held_before,
        "held_after": held,
        "seconds": seconds,
        "ok": "kvxferd" in params and held_before == 1 and held == 0,
    }
    say(
        f"  kvxferd  decode request aborted before its pull: the prefill daemon held"
        f" {held_before}, then {held} after {seconds:.1f} s (its lease's TTL is 60 s)"
    )
    return result


def refusal(decode: EngineProc, stranger: Any, transfers: TransferLog, say: Any) -> dict[str, Any]:
    """Send decode a ticket held on an incompatible daemon: the request must end (vLLM's
    ``kv_load_failure_policy``), with the daemon's explanation in the engine's log."""
    from kvxferd.vllm.daemon import EngineLink
    from kvxferd.vllm.params import Ticket

    ready = stranger.ready
    link = EngineLink(ready.engine_socket)
    try:
        held = link.hold("stranger-0", [[1, 2]], readers=1, ttl_ms=30_000)
    finally:
        link.close()
    ticket = Ticket(held.peer_address, held.request_id, ((1, 2),), (0,), held.expires_unix_ns, 64)
    before = decode.log.stat().st_size if decode.log.exists() else 0
    t0 = time.perf_counter()
    out = decode.generate(
        [
            {
                "id": "refusal",
                "tokens": prompt_tokens(64, 11),
                "max_tokens": 4,
                "kv_transfer_params": ticket.to_params(),
            }
        ]
    )[0]
    seconds = time.perf_counter() - t0
    st = transfers.wait("stranger-0")
    time.sleep(0.5)  # let the engine's log line land
    with open(decode.log, "rb") as f:
        f.seek(before)
        logged = [
            ln
            for ln in f.read().decode(errors="replace").splitlines()
            if "kvxferd: TP rank" in ln and ": pulling the KV cache" in ln
        ]
    state = state_name(st.state) if st else ""
    mismatches = [m.what for m in st.error.mismatches] if st is not None else []
    text = logged[0] if logged else ""
    if not mismatches and "mismatch(es)" in text:
        head = text.split("mismatch(es)", 1)[0].rsplit(" ", 2)[-2]
        mismatches = [f"mismatch {i + 1}" for i in range(int(head))] if head.isdigit() else []
    refused = state == "FAILED" or "refused" in text
    result = {
        "finish_reason": out.get("finish_reason"),
        "tokens": out.get("tokens"),
        "seconds": seconds,
        "transfer_state": state,
        "mismatches": mismatches,
        "logged": logged[:1],
        "ok": bool(logged) and refused and bool(mismatches) and seconds < 60,
    }
    say(
        f"  kvxferd  incompatible peer: the pull was {state or 'refused'} in {seconds:.1f} s,"
        f" the request finished with {result['finish_reason']!r}; vLLM's log: "
        + (logged[0].split("kvxferd: ", 1)[-1][:300] if logged else "(nothing logged)")
    )
    return result
