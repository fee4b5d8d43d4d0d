"""Profile every ``kvxferd serve`` process started with this directory on ``PYTHONPATH`` and
``KVX_PROFILE_DIR`` set: the main thread (the event loop) runs under cProfile from start-up,
and on exit the stats go to ``$KVX_PROFILE_DIR/<role>-<pid>.prof`` (role ``decode`` for a daemon
whose command line names a scheduler socket, else ``daemon``). Summarise them with
``python -m bench.profile_report``. For studies only: cProfile slows the daemon two- to
threefold, so its figures rank functions but are not the daemon's latency.

    KVX_PROFILE_DIR=/tmp/prof PYTHONPATH=bench/profile_hook:. python -m bench.control_path
"""

from __future__ import annotations

import atexit
import cProfile
import os
import sys

_DIR = os.environ.get("KVX_PROFILE_DIR", "")

if _DIR:
    _profile = cProfile.Profile()
    _profile.enable()

    def _dump() -> None:
        _profile.disable()
        argv = " ".join(sys.argv)
        if "serve" not in sys.argv:
            return  # another process that inherited the environment
        role = "decode" if "scheduler_socket" in argv else "daemon"
        _profile.dump_stats(os.path.join(_DIR, f"{role}-{os.getpid()}.prof"))

    atexit.register(_dump)
