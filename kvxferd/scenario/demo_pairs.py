"""The daemons of ``kvxferd demo``: the prefill/decode pair of each preset (pools, devices,
prefix caching, the prefill's fill pattern) and the pair the handshake must refuse (``ppl``
34 vs 66 with prefix caching on), with the refusal demonstrated against it.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvxferd.errors import KvxferdError
from kvxferd.scenario.client import (
    TERMINAL,
    DaemonClient,
    RpcFailure,
    state_name,
)
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import common_pb2

PRESET_NAMES = ("dense", "hybrid", "mla", "fp8")
DEFAULT_NUM_BLOCKS = {"dense": 256, "hybrid": 32, "mla": 64, "fp8": 256}
MIN_NUM_BLOCKS = 16
HYBRID_DECODE_PPL, HYBRID_PREFILL_PPL = 34, 66


@dataclass(frozen=True)
class PairConfig:
    """The two daemons of one scenario and how to pair their blocks."""

    prefill: DaemonOptions
    decode: DaemonOptions
    prefix_caching: bool


def devices(device: str) -> tuple[str, str]:
    if device == "cpu":
        return "cpu", "cpu"
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise KvxferdError(
            "--device cuda but torch sees no CUDA device", fix="use --device cpu on this machine"
        )
    return "cuda:0", "cuda:1" if n >= 2 else "cuda:0"


def demo_pair(preset: str, num_blocks: int, *, device: str = "cpu", seed: int = 0) -> PairConfig:
    """The prefill/decode daemons of ``kvxferd demo --preset preset``."""
    dev_p, dev_d = devices(device)
    fill = 1000 + seed
    if preset == "hybrid":
        decode_blocks = math.ceil(num_blocks * HYBRID_PREFILL_PPL / HYBRID_DECODE_PPL)
        return PairConfig(
            prefill=DaemonOptions(
                "prefill",
                f"hybrid:ppl={HYBRID_PREFILL_PPL},num_blocks={num_blocks}",
                device=dev_p,
                fill_seed=fill,
            ),
            decode=DaemonOptions(
                "decode",
                f"hybrid:ppl={HYBRID_DECODE_PPL},num_blocks={decode_blocks}",
                device=dev_d,
            ),
            prefix_caching=False,
        )
    spec = f"{preset}:num_blocks={num_blocks}"
    return PairConfig(
        prefill=DaemonOptions("prefill", spec, device=dev_p, prefix_caching=True, fill_seed=fill),
        decode=DaemonOptions("decode", spec, device=dev_d, prefix_caching=True),
        prefix_caching=True,
    )


def refusal_pair() -> PairConfig:
    """A pair the handshake must refuse: ppl 34 vs 66 with prefix caching on."""
    return PairConfig(
        prefill=DaemonOptions(
            "refused-prefill",
            f"hybrid:ppl={HYBRID_PREFILL_PPL},num_blocks=2",
            prefix_caching=True,
        ),
        decode=DaemonOptions(
            "refused-decode", f"hybrid:ppl={HYBRID_DECODE_PPL},num_blocks=2", prefix_caching=True
        ),
        prefix_caching=True,
    )


def demonstrate_refusal(prefill: DaemonClient, decode: DaemonClient) -> dict[str, Any]:
    """Hold one request on the refusing prefill daemon and pull it; the handshake must refuse."""
    out: dict[str, Any] = {
        "refused": False,
        "code": "",
        "message": "",
        "mismatches": [],
        "error": "",
    }
    rid = f"refusal-{secrets.token_hex(3)}"
    try:
        hold = prefill.hold(rid, [[0], [0]])
        resp = decode.start_pull(f"{rid}-pull", hold, [[0, 1], [0]])
    except RpcFailure as exc:
        out["code"] = exc.code.name
        out["message"] = exc.details
        out["explanation"] = exc.explain()
        if exc.error is not None:
            out["mismatches"] = [
                {"what": m.what, "local": m.local, "remote": m.remote, "fix": m.fix}
                for m in exc.error.mismatches
            ]
        if exc.code.name == "FAILED_PRECONDITION" and exc.method.endswith("StartPull"):
            out["refused"] = True
        else:
            out["error"] = f"expected FAILED_PRECONDITION on StartPull, got {exc}"
        return out
    st = resp.status
    deadline = time.monotonic() + 30
    while st.state not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.05)
        st = decode.get_transfer(st.transfer_id)
    kind = common_pb2.ErrorKind.Name(st.error.kind) if st.HasField("error") else ""
    out["code"] = state_name(st.state)
    out["message"] = st.error.message if st.HasField("error") else ""
    out["error"] = (
        f"StartPull accepted the pull (it ended {state_name(st.state)} {kind}); the handshake"
        " must refuse it with FAILED_PRECONDITION"
    )
    return out
