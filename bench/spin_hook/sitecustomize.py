"""Keep the event loop of every ``kvxferd serve`` started with this directory on ``PYTHONPATH``
and ``KVX_SPIN`` set from ever sleeping: a task that yields at every turn, so uvloop polls its
sockets with a zero timeout instead of blocking in epoll_wait. ``KVX_SPIN=decode`` spins only
the daemon with a scheduler socket; any other value, every daemon. For studies only (it costs a
core per daemon): it asks how much of a pull's time is the host waking an idle thread.

    KVX_SPIN=1 PYTHONPATH=bench/spin_hook:. python -m bench.control_path --device cuda
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any

_MODE = os.environ.get("KVX_SPIN", "")


async def _spin() -> None:
    while True:
        await asyncio.sleep(0)


def _wants() -> bool:
    if not _MODE or "serve" not in sys.argv:
        return False
    return _MODE != "decode" or "scheduler_socket" in " ".join(sys.argv)


if _wants():
    import uvloop

    _run = uvloop.run

    def _spinning_run(main: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
        async def wrapped() -> Any:
            spinner = asyncio.get_running_loop().create_task(_spin())
            try:
                return await main
            finally:
                spinner.cancel()

        return _run(wrapped(), **kwargs)

    uvloop.run = _spinning_run


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` too (Python imports only the first), so
    this hook combines with bench/timeline_hook or bench/profile_hook."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(os.path.dirname(path)) == here or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_chained_sitecustomize", path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["_chained_sitecustomize"] = module
            spec.loader.exec_module(module)
        return


_chain()
