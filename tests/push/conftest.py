"""Real daemons (``kvxferd serve`` subprocesses) in push mode, started with a TOML config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.scenario.daemons import DaemonOptions
from tests.service.conftest import Daemons, launch


def mode_config(tmp: Path, mode: str, strategy: str = "auto") -> tuple[str, ...]:
    """``--config`` flags of a file setting ``transfer.mode`` (and ``transfer.strategy``)."""
    path = tmp / f"{mode}-{strategy}.toml"
    path.write_text(f'[transfer]\nmode = "{mode}"\nstrategy = "{strategy}"\n', encoding="utf-8")
    return ("--config", str(path))


@pytest.fixture(scope="module")
def push(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """Push-mode pairs (dense, hybrid, hybrid with prefix caching; prefills pattern-filled) and
    a pull-mode decode daemon."""
    tmp = tmp_path_factory.mktemp("push")
    on, off = mode_config(tmp, "push"), mode_config(tmp, "pull")
    ds = launch(
        tmp,
        DaemonOptions("prefill", "dense:num_blocks=64", fill_seed=3, extra=on),
        DaemonOptions("decode", "dense:num_blocks=64", extra=on),
        DaemonOptions("h-prefill", "hybrid", fill_seed=9, extra=on),
        DaemonOptions("h-decode", "hybrid", extra=on),
        DaemonOptions("hp-prefill", "hybrid", prefix_caching=True, fill_seed=5, extra=on),
        DaemonOptions("hp-decode", "hybrid", prefix_caching=True, extra=on),
        DaemonOptions("pull-decode", "dense:num_blocks=64", extra=off),
    )
    yield ds
    ds.stop()
