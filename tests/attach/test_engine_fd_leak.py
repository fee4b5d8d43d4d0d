"""The engine client lets go of what a failed attach or allocation made: descriptors, mappings,
/dev/shm files, and the daemon's side of an Attach it could not finish.

Before: ``shared_tensors`` that ran out of descriptors part-way kept every segment it had
created (mapped, one descriptor each, its /dev/shm file) until the process exited; an OWNED
``attach`` that could not map every export left the mapped ones to the exception's traceback
(a descriptor each, for as long as the caller kept the error) and left the daemon attached, so
every other Attach was refused until ``pool.session_grace_ms`` passed; and both blamed "the
daemon's open-files limit". Here the engine's own open-files limit is lowered (setrlimit in a
subprocess, so that the test process keeps its own) against a real daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.engine import EngineClient
from kvxferd.errors import EngineDetached
from kvxferd.scenario.daemons import DaemonOptions
from tests.service.conftest import Daemons, launch

ROOT = Path(__file__).resolve().parents[2]
SMALL = "dense:num_blocks=4,num_layers=2"

# Runs in a subprocess: argv = engine socket, what to try ("shared" or "owned"). Prints one
# JSON line: the error, the descriptors open before and after (the error still held), the
# kvxferd files in /dev/shm that appeared, the daemon's state right after, and how the next
# Attach (under the usual limit) went.
ENGINE = """
import json, os, resource, sys
from kvxferd.engine import EngineClient, shared_tensors
from kvxferd.layout.presets import preset

MANY = "dense:num_blocks=1,num_layers=160"  # 64 KiB a region, one descriptor each
SPARE = 40  # descriptors past those open: runs out part-way through MANY's 320 regions

def fds():
    return len(os.listdir("/proc/self/fd"))

def shm():
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvxferd-")}

client = EngineClient(sys.argv[1], timeout_s=30)
client.describe()  # the connection is open before counting
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
before, files = fds(), shm()
resource.setrlimit(resource.RLIMIT_NOFILE, (before + SPARE, hard))
try:
    if sys.argv[2] == "shared":
        shared_tensors(preset(MANY))
    else:
        client.attach(MANY, "owned")
    error = None
except Exception as exc:
    error = exc  # held, as a caller that logs or re-raises it does
after = fds()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
state = client.describe().state
try:
    client.attach("dense:num_blocks=4,num_layers=2", "owned").detach()
    again = "attached"
except Exception as exc:
    again = str(exc)
client.close()
print(json.dumps({"error": str(error), "before": before, "after": after,
                  "new_files": sorted(shm() - files), "state": state, "again": again}))
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("engine-fds"),
        DaemonOptions("att", SMALL, extra=("--set", "pool.mode=attached")),
    )
    yield ds
    ds.stop()


def _engine(socket: str, what: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, socket, what],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("what", ["shared", "owned"])
def test_running_out_of_descriptors_leaves_nothing_open_and_names_the_engines_limit(
    daemon: Daemons, what: str
) -> None:
    got = _engine(daemon["att"].engine_socket, what)
    before, after = got["before"], got["after"]
    assert isinstance(before, int) and isinstance(after, int)
    assert after - before <= 2, f"{after - before} descriptors left open by the failure ({got})"
    assert got["new_files"] == [], f"left in /dev/shm: {got['new_files']}"
    # OWNED: the daemon's side of the Attach was undone at once, not after the session grace.
    assert got["state"] == "DETACHED", got
    assert got["again"] == "attached", got
    text = str(got["error"])
    assert "the engine's open-files limit" in text and "LimitNOFILE" in text, text
    assert "daemon's open-files" not in text, text
    assert daemon["att"].alive()  # type: ignore[operator]


def test_a_session_that_does_not_open_detaches_the_daemon_at_once(
    daemon: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session is refused here by a fake (``_open_session`` raises, as when the socket
    drops between Attach and Session): the daemon's pool must not wait out the grace."""

    def refuse(self: EngineClient, att: object) -> None:
        raise EngineDetached("the session did not open", fix="check the daemon's log")

    client = EngineClient(daemon["att"].engine_socket, timeout_s=30)
    try:
        with monkeypatch.context() as m:
            m.setattr(EngineClient, "_open_session", refuse)
            with pytest.raises(EngineDetached, match="the session did not open"):
                client.attach(SMALL, "owned")
        assert client.describe().state == "DETACHED"
        client.attach(SMALL, "owned").detach()  # no ALREADY_EXISTS for the failed one
    finally:
        client.close()
