"""Turn off eager task starts (kvxferd/tasks.py) in every process started with this directory
on ``PYTHONPATH``, so an A/B on Python >= 3.12 can tell what eager starts give from what the
rest of a change gives: ``kvxferd.tasks.start_now`` is then ``create_task`` and the reader
waits a loop turn for its confirmation to be sent, as on Python 3.11. For studies only:

    PYTHONPATH=bench/lazy_hook:. python -m bench.control_path --device cuda
"""

from __future__ import annotations

import kvxferd.tasks as _tasks

_tasks._EAGER = None
_tasks.EAGER = False
