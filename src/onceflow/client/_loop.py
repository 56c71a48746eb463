"""One background event loop per process for the blocking clients (producers, consumers)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["background_loop", "run_sync"]

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def background_loop() -> asyncio.AbstractEventLoop:
    """The shared loop, started on first use in a daemon thread named ``onceflow-client``."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="onceflow-client", daemon=True).start()
            _loop = loop
        return _loop


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the background loop and wait for its result in the calling thread."""
    loop = background_loop()
    if _running_loop() is loop:
        coro.close()
        raise RuntimeError("a blocking onceflow client method was called from its own background loop")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
