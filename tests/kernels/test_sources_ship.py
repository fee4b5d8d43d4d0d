"""The CUDA sources are found inside the package (kvxferd/kernels/cuda links to cuda/), which
is what the wheel ships as package data: an installed kvxferd builds the same kernels."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kvxferd.kernels.loader import cuda_source_dir

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_source_is_reachable_from_the_package() -> None:
    shipped = {p.name for p in cuda_source_dir().iterdir()}
    in_repo = {p.name for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cuh", ".cpp")}
    assert in_repo and in_repo <= shipped
    assert cuda_source_dir().is_relative_to(ROOT / "kvxferd")


def test_package_data_names_the_kernel_sources() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["kvxferd"]
    for source in (ROOT / "cuda").iterdir():
        assert any(Path("kernels/cuda", source.name).match(p) for p in patterns), source.name
