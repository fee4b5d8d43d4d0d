"""The verdict of ``kvxferd demo --engine vllm``: per prompt, whether decode's greedy tokens
equal the single engine's with each connector and the decode TTFT; the control (prompt B with
A's KV must reproduce A); the refusal of an incompatible peer; nothing left held or mapped.
"""

from __future__ import annotations

import math
import time
from typing import Any, TextIO

from kvxferd.scenario.report import table
from kvxferd.scenario.vllm_engines import BLOCK_SIZE, Prompt
from kvxferd.scenario.vllm_pair import Row, median


def report(
    doc: dict[str, Any],
    errors: list[str],
    out: TextIO,
    *,
    prompts: list[Prompt],
    control: tuple[Prompt, Prompt],
    ref: dict[str, list[int]],
    kvxferd: tuple[dict[str, Row], Row],
    nixl: tuple[dict[str, Row], Row | None],
    started: float,
) -> None:
    """Print the per-prompt table and the checks; add them to ``doc`` and what failed to
    ``errors``. ``ref`` holds the single engine's tokens per prompt name, ``kvxferd`` and
    ``nixl`` each connector's rows and control row (``nixl``'s empty when it did not run)."""
    ctl_a, ctl_b = control
    k_rows, k_ctl = kvxferd
    n_rows, n_ctl = nixl
    per_prompt = []
    table_rows = []
    for p in prompts:
        k = k_rows[p.name]
        n = n_rows.get(p.name)
        same_k = k.tokens == ref[p.name] and not k.error
        same_n = (n.tokens == ref[p.name]) if n is not None else None
        ratio = k.ttft_s / n.ttft_s if n is not None and n.ttft_s > 0 else float("nan")
        if not same_k:
            errors.append(
                f"{p.name}: kvxferd decode tokens {k.tokens} != single {ref[p.name]}"
                + (f" ({k.error})" if k.error else "")
            )
        nblocks = -(-len(p.tokens) // BLOCK_SIZE)
        per_prompt.append(
            {
                "prompt": p.name,
                "tokens": len(p.tokens),
                "note": p.note,
                "prompt_blocks": nblocks,
                "pulled_blocks": k.pulled_blocks,
                "transfer": k.state,
                "identical_kvxferd": same_k,
                "identical_nixl": same_n,
                "ttft_kvxferd_ms": k.ttft_s * 1e3,
                "ttft_nixl_ms": n.ttft_s * 1e3 if n else None,
                "ttft_ratio": ratio,
                "prefill_kvxferd_ms": k.prefill_s * 1e3,
                "reference": ref[p.name],
                "decode_kvxferd": k.tokens,
                "decode_nixl": n.tokens if n else None,
            }
        )
        table_rows.append(
            [
                p.name,
                str(len(p.tokens)),
                f"{k.pulled_blocks}/{nblocks}" if k.pulled_blocks is not None else "-",
                "yes" if same_k else "NO",
                "-" if same_n is None else ("yes" if same_n else "NO"),
                f"{k.ttft_s * 1e3:.1f}",
                f"{n.ttft_s * 1e3:.1f}" if n else "-",
                f"{ratio:.2f}" if math.isfinite(ratio) else "-",
            ]
        )
    print(
        table(
            [
                "prompt",
                "tokens",
                "pulled/blocks",
                "same (kvxferd)",
                "same (nixl)",
                "TTFT kvxferd ms",
                "TTFT nixl ms",
                "ratio",
            ],
            table_rows,
        ),
        file=out,
    )
    ctl_ok = k_ctl.tokens == ref[ctl_a.name] and k_ctl.tokens != ref[ctl_b.name]
    meaningful = ref[ctl_a.name] != ref[ctl_b.name]
    if not meaningful:
        errors.append(
            "control: prompts A and B give the same output on one engine; the"
            " control cannot tell pulled KV from recomputation"
        )
    elif not ctl_ok:
        errors.append(
            f"control FAILED: decode given B plus A's KV produced {k_ctl.tokens};"
            f" A alone gives {ref[ctl_a.name]}, B alone {ref[ctl_b.name]}"
        )
    n_ctl_ok = (n_ctl.tokens == ref[ctl_a.name]) if n_ctl is not None else None
    print(
        f"control: decode given prompt B ({len(ctl_b.tokens)} tokens) plus prompt A's KV"
        f" {'reproduced A' if ctl_ok else 'did NOT reproduce A'}"
        f" ({'B alone gives other tokens' if meaningful else 'A and B agree: inconclusive'}):"
        f" {'PASS' if ctl_ok and meaningful else 'FAIL'}"
        + ("" if n_ctl_ok is None else f"; NixlConnector: {'PASS' if n_ctl_ok else 'FAIL'}"),
        file=out,
    )
    tk = median([k_rows[p.name].ttft_s for p in prompts])
    tn = median([n_rows[p.name].ttft_s for p in prompts]) if n_rows else float("nan")
    ratio = tk / tn if math.isfinite(tn) and tn > 0 else float("nan")
    print(
        f"decode TTFT, median over prompts: kvxferd {tk * 1e3:.1f} ms"
        + (
            f", NixlConnector {tn * 1e3:.1f} ms, ratio {ratio:.2f}"
            f" ({'no worse' if ratio <= 1.0 else 'slower'})"
            if n_rows
            else ""
        ),
        file=out,
    )
    ref_doc = doc.get("refusal") or {}
    print(
        f"incompatible peer: {'PASS' if ref_doc.get('ok') else 'FAIL'} (pull"
        f" {ref_doc.get('transfer_state') or 'refused'}, request finished with"
        f" {ref_doc.get('finish_reason')!r} in {ref_doc.get('seconds', float('nan')):.1f} s,"
        f" {len(ref_doc.get('mismatches') or [])} mismatches named in vLLM's log)",
        file=out,
    )
    if not ref_doc.get("ok"):
        errors.append(f"incompatible peer: {ref_doc}")
    held = int(doc.get("held_after_run", -1))
    if held:
        errors.append(f"the prefill daemon still holds {held} requests after the run")
    if doc.get("shm_left"):
        errors.append(f"shared memory left in /dev/shm: {doc['shm_left']}")
    print(
        f"after the run: {held} requests held on the prefill daemon,"
        f" {len(doc.get('shm_left', []))} shared-memory segments left",
        file=out,
    )
    doc.update(
        {
            "per_prompt": per_prompt,
            "control": {
                "passed": ctl_ok and meaningful,
                "decode_tokens": k_ctl.tokens,
                "reference_a": ref[ctl_a.name],
                "reference_b": ref[ctl_b.name],
                "nixl_passed": n_ctl_ok,
            },
            "ttft_median_kvxferd_ms": tk * 1e3,
            "ttft_median_nixl_ms": tn * 1e3,
            "ttft_ratio": ratio,
            "nixl_compared": bool(n_rows),
            "total_s": time.monotonic() - started,
            "errors": errors,
        }
    )
