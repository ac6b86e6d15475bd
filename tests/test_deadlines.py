"""Whole-request deadlines (router/deadlines.py): what cancels a task, and what is a timeout."""

from __future__ import annotations

import asyncio

from kvroute.router.deadlines import Deadlines


async def test_a_task_past_its_deadline_is_cancelled_and_told_so() -> None:
    deadlines = Deadlines(tick_s=60.0)  # swept by hand below
    seen: list[str] = []

    async def request() -> str:
        task: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
        deadlines.track(task, deadline=10.0)
        try:
            await asyncio.Event().wait()
            return "answered"
        except asyncio.CancelledError:
            timed_out = deadlines.release(task)
            seen.append(f"timed out: {timed_out}, cancelling: {task.cancelling()}")
            if not timed_out:
                raise
            return "504"

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    deadlines.sweep(now=9.9)  # not yet
    await asyncio.sleep(0)
    assert not task.done()
    deadlines.sweep(now=10.0)
    assert await task == "504"
    assert seen == ["timed out: True, cancelling: 0"]  # taken back: the task may answer


async def test_a_client_that_goes_away_is_no_timeout_and_a_released_task_is_left_alone() -> None:
    deadlines = Deadlines(tick_s=60.0)
    started = asyncio.Event()
    results: list[bool] = []

    async def request() -> None:
        task: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
        deadlines.track(task, deadline=10.0)
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            results.append(deadlines.release(task))
            raise

    task = asyncio.create_task(request())
    await started.wait()
    task.cancel()  # the client disconnected
    await asyncio.gather(task, return_exceptions=True)
    assert results == [False] and task.cancelled()

    async def quick() -> str:
        me: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
        deadlines.track(me, deadline=10.0)
        deadlines.release(me)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return "answered"

    other = asyncio.create_task(quick())
    await asyncio.sleep(0)
    deadlines.sweep(now=99.0)
    assert await other == "answered"


async def test_the_sweeper_runs_on_its_tick() -> None:
    deadlines = Deadlines(tick_s=0.01)
    deadlines.start()
    try:

        async def request() -> str:
            task: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
            deadlines.track(task, deadline=0.0)  # due at once
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                return "504" if deadlines.release(task) else "cancelled"
            return "answered"

        assert await asyncio.wait_for(request(), timeout=30) == "504"
    finally:
        await deadlines.close()
