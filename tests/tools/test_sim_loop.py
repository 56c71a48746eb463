"""The simulator's event loop (tools/onceflow_tools/sim/loop.py): a paused process's callbacks."""

from __future__ import annotations

import asyncio
import contextvars

from onceflow_tools.sim.loop import SimLoop, owner


def test_a_timer_cancelled_while_its_process_was_paused_does_not_run_when_it_resumes() -> None:
    """Found by seed 139410 of the cluster soak: a server paused (SIGSTOP) while a read waited
    under ``asyncio.timeout`` had both the read's answer and the timeout come due; on resume the
    read finished first and left the timeout (cancelling its timer), but the loop ran the held
    timer anyway: an AssertionError in asyncio's Timeout, logged as the server's. A real loop
    never runs a handle cancelled before its turn."""
    loop = SimLoop(pausable=True)
    server = object()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    answered: list[str] = []

    async def read(answer: asyncio.Future[str]) -> None:
        async with asyncio.timeout(1.0):
            answered.append(await answer)

    async def world() -> None:
        answer: asyncio.Future[str] = loop.create_future()
        ctx = contextvars.copy_context()
        ctx.run(owner.set, server)
        task = loop.create_task(read(answer), context=ctx)
        await asyncio.sleep(0.5)
        loop.freeze(server)
        answer.set_result("bytes")  # the answer comes while the server is paused
        await asyncio.sleep(2.0)  # and so does the read's timeout
        loop.thaw(server)
        await task
        await asyncio.sleep(0.1)

    try:
        loop.run_until_complete(world())
    finally:
        loop.close()
    assert answered == ["bytes"]
    assert errors == []
