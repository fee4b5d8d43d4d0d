"""``kvxferd serve`` flag errors are one ``kvxferd: error:`` line and exit status 2, in-process
(before any daemon part is built)."""

from __future__ import annotations

import pytest

from kvxferd.cli import main


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--set", "foo"], ["--set 'foo'", "SECTION.KEY=VALUE", "docs/config.md"]),
        (["--set", "=1"], ["--set '=1'", "SECTION.KEY=VALUE"]),
        (["--set", "sever.listen=1"], ["sever.listen", "did you mean server.listen"]),
        (["--tp", "3"], ["--tp '3'", "RANK/SIZE"]),
        (["--listen", "127.0.0.1:99999"], ["server.listen", "out of range"]),
        (["--set", "peers.allow=10.0.0.1/8"], ["peers.allow", "10.0.0.0/8"]),
    ],
)
def test_bad_serve_flags_are_one_clear_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvxferd: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
