"""Fixtures of the fuzz suite: the daemons under fuzz, and the session's fuzz summary."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz import world as w
from tests.fuzz.harness import STATS


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[w.World]:
    """Prefill + decode (owned pools) and an attached-mode daemon, with what the fuzz knows."""
    ds = w.start(tmp_path_factory.mktemp("fuzz"))
    world = w.World({name: ds[name] for name in ("prefill", "decode", "att")})
    try:
        world.learn()
        yield world
    finally:
        world.close()
        ds.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if STATS.calls:
        terminalreporter.write_sep("-", "kvxferd fuzz summary")
        terminalreporter.write_line(STATS.summary())
        STATS.write_report()
