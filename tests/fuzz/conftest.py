"""Fixtures of the fuzz suite: the daemons under fuzz, and the session's fuzz summary."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz import world as w
from tests.fuzz.harness import BUDGET, STATS, WEIGHTS


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[w.World]:
    """Prefill + decode (owned pools) and an attached-mode daemon, with what the fuzz knows."""
    ds = w.start(tmp_path_factory.mktemp("fuzz"))
    world = w.World({name: ds[name] for name in ("prefill", "decode", "att")})
    world.logs = {d.name: d.log_path for d in ds.set}
    world.daemon_set = ds.set
    try:
        world.learn()
        yield world
    finally:
        world.close()  # the daemons' exit status is test_zz_daemons_stop_cleanly_on_sigterm's


def pytest_collection_finish(session: pytest.Session) -> None:
    """Share KVXFERD_FUZZ_SECONDS among the fuzz tests actually selected."""
    names = [getattr(item, "originalname", "") for item in session.items]
    BUDGET.plan([WEIGHTS[n] for n in names if n in WEIGHTS])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if STATS.calls:
        terminalreporter.write_sep("-", "kvxferd fuzz summary")
        terminalreporter.write_line(STATS.summary())
        STATS.write_report()
