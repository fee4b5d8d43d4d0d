"""Units of kvxferd.vllm.settings: the connector's config, read from vLLM's config objects
(stand-ins here: no vLLM needed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvxferd.vllm.settings import ConnectorSettings


def _vllm_config(
    extra: dict[str, Any], tp: int = 1, model: Any = "m/llama", **parallel: int
) -> Any:
    par = {"tensor_parallel_size": tp, "pipeline_parallel_size": 1, **parallel}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, engine_id="e-1"),
        parallel_config=SimpleNamespace(**par),
        model_config=SimpleNamespace(served_model_name=model, model="m/base"),
    )


def test_settings_read_the_extra_config_with_defaults(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    s = ConnectorSettings.from_vllm_config(
        _vllm_config(
            {"engine_socket": "/run/e.sock", "token_file": str(token), "hold_ttl_ms": 500},
            model=["served-a", "served-b"],
        )
    )
    assert s == ConnectorSettings(
        engine_sockets=("/run/e.sock",),
        token="s3cret",
        hold_ttl_ms=500,
        pull_deadline_ms=0,
        daemon_wait_s=60.0,
        fingerprint="served-a",
        engine_id="e-1",
    )

    assert s.tp_size == 1 and s.engine_socket(0) == "/run/e.sock"


@pytest.mark.parametrize(
    ("raw", "tp", "sockets"),
    [
        (
            "/run/kvxferd/rank{rank}/engine.sock",
            2,
            ("/run/kvxferd/rank0/engine.sock", "/run/kvxferd/rank1/engine.sock"),
        ),
        ("/run/k{rank}.sock", 4, ("/run/k0.sock", "/run/k1.sock", "/run/k2.sock", "/run/k3.sock")),
        ("/run/k{rank}.sock", 1, ("/run/k0.sock",)),
        (["/a/e.sock", "/b/e.sock"], 2, ("/a/e.sock", "/b/e.sock")),
    ],
)
def test_each_tp_rank_finds_its_own_daemon(raw: Any, tp: int, sockets: tuple[str, ...]) -> None:
    s = ConnectorSettings.from_vllm_config(_vllm_config({"engine_socket": raw}, tp=tp))
    assert s.engine_sockets == sockets and s.tp_size == tp
    assert [s.engine_socket(r) for r in range(tp)] == list(sockets)
    with pytest.raises(ValueError, match=f"TP rank {tp} is outside the {tp} engine sockets"):
        s.engine_socket(tp)


@pytest.mark.parametrize(
    ("extra", "tp", "parallel", "says"),
    [
        ({}, 1, {}, "engine_socket"),
        ({"engine_socket": ""}, 1, {}, "engine_socket"),
        ({"engine_socket": "/run/e.sock"}, 2, {}, "every TP rank needs its own kvxferd daemon"),
        ({"engine_socket": ["/a.sock"]}, 2, {}, "lists 1 paths for tensor_parallel_size 2"),
        ({"engine_socket": ["/a.sock", "/a.sock"]}, 2, {}, "names a path twice"),
        ({"engine_socket": ["/a.sock", ""]}, 2, {}, "must hold non-empty paths"),
        ({"engine_socket": "/run/{rank}/{dp}.sock"}, 2, {}, "whose only field is {rank}"),
        (
            {"engine_socket": "/run/k{rank}.sock"},
            2,
            {"pipeline_parallel_size": 2},
            "pipeline_parallel_size 2: pipeline parallelism splits the layers",
        ),
        (
            {"engine_socket": "/run/e.sock"},
            1,
            {"decode_context_parallel_size": 2},
            "decode_context_parallel_size 2: context parallelism",
        ),
        (
            {"engine_socket": "/run/k{rank}.sock"},
            2,
            {"nnodes": 2},
            "nnodes 2: the scheduler holds a finished prefill on every TP rank's daemon",
        ),
    ],
)
def test_a_config_the_connector_cannot_run_is_refused_with_the_fix(
    extra: dict[str, Any], tp: int, parallel: dict[str, int], says: str
) -> None:
    with pytest.raises(ValueError, match="KvxferdConnector") as err:
        ConnectorSettings.from_vllm_config(_vllm_config(extra, tp=tp, **parallel))
    assert says in str(err.value), str(err.value)
    assert "Fix:" in str(err.value) and "docs/vllm.md" in str(err.value)
