"""Units of kvxferd.vllm.settings: the connector's config, read from vLLM's config objects
(stand-ins here: no vLLM needed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvxferd.vllm.settings import ConnectorSettings


def _vllm_config(extra: dict[str, Any], tp: int = 1, model: Any = "m/llama") -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, engine_id="e-1"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
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
        engine_socket="/run/e.sock",
        token="s3cret",
        hold_ttl_ms=500,
        pull_deadline_ms=0,
        daemon_wait_s=60.0,
        fingerprint="served-a",
        engine_id="e-1",
    )


@pytest.mark.parametrize(
    ("extra", "tp", "says"),
    [
        ({}, 1, "engine_socket"),
        ({"engine_socket": ""}, 1, "engine_socket"),
        ({"engine_socket": "/run/e.sock"}, 2, "tensor_parallel_size 2"),
    ],
)
def test_a_config_the_connector_cannot_run_is_refused_with_the_fix(
    extra: dict[str, Any], tp: int, says: str
) -> None:
    with pytest.raises(ValueError, match="KvxferdConnector") as err:
        ConnectorSettings.from_vllm_config(_vllm_config(extra, tp=tp))
    assert says in str(err.value) and "Fix:" in str(err.value) and "docs/vllm.md" in str(err.value)
