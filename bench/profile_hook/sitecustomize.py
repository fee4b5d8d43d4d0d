"""Profile every ``kvxferd serve`` process started with this directory on ``PYTHONPATH`` and
``KVX_PROFILE_DIR`` set: the main thread (the event loop) runs under cProfile from start-up,
and on exit the stats go to ``$KVX_PROFILE_DIR/<role>-<pid>.prof`` (role ``decode`` for a daemon
whose command line names a scheduler socket, else ``daemon``). ``KVX_PROFILE_AFTER_S``
(seconds, default 0) starts the profile that long after start-up instead (a SIGALRM timer,
handled on the main thread), so that start-up and the first pulls (the extension's loading, the
first launch of each kernel) are not averaged into every pull. Summarise them with
``python -m bench.profile_report``. For studies only: cProfile slows the daemon two- to
threefold, so its figures rank functions but are not the daemon's latency.

    KVX_PROFILE_DIR=/tmp/prof KVX_PROFILE_AFTER_S=15 PYTHONPATH=bench/profile_hook:. \
        python -m bench.control_path
"""

from __future__ import annotations

import atexit
import cProfile
import os
import signal
import sys

_DIR = os.environ.get("KVX_PROFILE_DIR", "")

if _DIR:
    _profile = cProfile.Profile()
    _after = float(os.environ.get("KVX_PROFILE_AFTER_S", "0") or 0)
    if _after > 0:
        signal.signal(signal.SIGALRM, lambda *_: _profile.enable())
        signal.setitimer(signal.ITIMER_REAL, _after)
    else:
        _profile.enable()

    def _dump() -> None:
        _profile.disable()
        argv = " ".join(sys.argv)
        if "serve" not in sys.argv:
            return  # another process that inherited the environment
        role = "decode" if "scheduler_socket" in argv else "daemon"
        _profile.dump_stats(os.path.join(_DIR, f"{role}-{os.getpid()}.prof"))

    atexit.register(_dump)
