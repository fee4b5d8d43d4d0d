"""kvxferd/tasks.py: start_now runs a task's first step before it returns on Python >= 3.12
(eager tasks) and is create_task before; either way the task then runs as any other."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from kvxferd.tasks import EAGER, start_now


def test_eager_exactly_where_python_has_eager_tasks() -> None:
    assert (sys.version_info >= (3, 12)) == EAGER


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_the_first_step_runs_now_where_eager_and_the_rest_later(loop_factory: object) -> None:
    steps: list[str] = []

    async def work() -> int:
        steps.append("first")
        await asyncio.sleep(0)
        steps.append("second")
        return 7

    async def main() -> None:
        task = start_now(work())
        assert steps == (["first"] if EAGER else [])
        assert not task.done()
        assert await task == 7
        assert steps == ["first", "second"]

        async def at_once() -> str:
            return "done"

        quick = start_now(at_once())
        assert quick.done() == EAGER  # never suspended: finished inside start_now
        assert await quick == "done"

    runner = asyncio.Runner(loop_factory=loop_factory)  # type: ignore[arg-type]
    with runner:
        runner.run(main())


def test_an_eager_task_sees_itself_as_the_current_task() -> None:
    async def main() -> None:
        seen: list[asyncio.Task[None] | None] = []

        async def who() -> None:
            seen.append(asyncio.current_task())
            await asyncio.sleep(0)

        task = start_now(who())
        await task
        assert seen == [task]

    uvloop.run(main())
