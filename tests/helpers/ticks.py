"""A task that counts the event loop's turns: whether other tasks got to run while some work did."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def ticking() -> AsyncIterator[list[int]]:
    """While the block runs, ``ticks[0]`` (the list yielded) grows by one each time the loop lets
    the ticker run: work on the loop that never yields leaves it where it was."""
    ticks = [0]

    async def ticker() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    try:
        await asyncio.sleep(0)
        yield ticks
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
