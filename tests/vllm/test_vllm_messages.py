"""Refusals of the vLLM integration point at docs/vllm.md exactly once, also where they wrap an
error whose fix names it already (no vLLM, no GPU: the GPU attach is refused on CPU tensors
before it reaches the daemon)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvxferd.errors import KvxferdError
from kvxferd.scenario.vllm_pair import check_vllm
from kvxferd.vllm.daemon import EngineLink
from kvxferd.vllm.gpu import attach_cuda
from kvxferd.vllm.kinds import see_doc
from tests.vllm.test_vllm_gpu_spec import vllm_views

DOC = "docs/vllm.md"


def test_a_refused_gpu_attach_names_the_docs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    cfg, _, views = vllm_views("LBHNC")  # CPU tensors: the description refuses them ...
    link = EngineLink(str(tmp_path / "engine.sock"))  # ... before this is ever called
    with pytest.raises(RuntimeError, match="not on a GPU") as ei:
        attach_cuda(link, cfg, views, model="m", prefix_caching=False, wait_s=0.1, on_release=print)
    assert str(ei.value).count(DOC) == 1, str(ei.value)


def test_the_demo_without_vllm_names_the_docs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib.util.find_spec("vllm") -> None
    with pytest.raises(KvxferdError, match="needs vLLM in this Python") as ei:
        check_vllm()
    assert str(ei.value).count(DOC) == 1, str(ei.value)


def test_see_doc_appends_the_pointer_only_when_missing() -> None:
    wrapped = KvxferdError("Engine.Attach failed", fix=f"read the daemon's log (see {DOC})")
    assert see_doc(f"attaching failed: {wrapped}").count(DOC) == 1
    assert see_doc("attaching failed: no such socket") == (
        f"attaching failed: no such socket (see {DOC})"
    )
