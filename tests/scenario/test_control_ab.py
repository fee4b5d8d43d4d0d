"""kvxferd/scenario/control_ab.py (bench/control_ab.py's measurement): two real decode daemons,
each importing its own tree's kvxferd, pulls alternating between them, and the figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvxferd.scenario import control_ab

MARK = """import os as _os
if _os.environ.get("KVX_AB_TEST_MARK"):
    open(f"{_os.environ['KVX_AB_TEST_MARK']}.{_os.getpid()}", "w").close()
"""


@pytest.mark.slow
def test_each_decode_daemon_runs_its_own_tree_and_both_are_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The base tree: this kvxferd, whose entry point leaves a mark naming the process.
    base = tmp_path / "base"
    shutil.copytree(
        control_ab.HERE / "kvxferd", base / "kvxferd", ignore=shutil.ignore_patterns("__pycache__")
    )
    main = base / "kvxferd" / "__main__.py"
    main.write_text(MARK + main.read_text())
    monkeypatch.setenv("KVX_AB_TEST_MARK", str(tmp_path / "mark"))
    fig = control_ab.measure(base, control_ab.HERE, pulls=20, warmup=2)
    json.dumps(fig)  # what --json writes
    a, b = fig["sides"]["a"], fig["sides"]["b"]
    marked = {int(p.suffix[1:]) for p in tmp_path.glob("mark.*")}
    assert marked == {a["pid"]}  # only the base daemon ran the base tree
    assert a["tree"] == str(base) and b["tree"] == str(control_ab.HERE)
    for side in (a, b):
        assert 0 < side["p50_ms"] <= side["p99_ms"]
        assert {"plan", "confirm", "transfer"} <= side["stages_p50_ms"].keys()
    lo, hi = fig["diff_b_minus_a_ms"]["ci95"]
    assert lo <= hi and fig["pulls_per_side"] == 20


def test_a_tree_without_kvxferd_is_refused_before_any_daemon_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no kvxferd package"):
        control_ab.measure(tmp_path, control_ab.HERE, pulls=1, warmup=0)
