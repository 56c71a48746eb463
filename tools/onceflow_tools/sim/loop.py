"""A deterministic asyncio event loop on simulated time.

:class:`SimLoop` is asyncio's own ``BaseEventLoop`` with two things replaced: the clock and the
wait for I/O. ``time()`` is a number the loop advances itself: when nothing is ready to run, it
jumps straight to the next timer instead of sleeping, so a simulated minute of timeouts, sweeps
and retries costs only the CPU of the code that runs in it. There are no sockets and no threads:
``run_in_executor`` runs the function on the loop itself after a delay the simulation chooses (a
disk write or sync taking time), so every interleaving comes from the seeded choices of the
simulation, never from the machine.

Ready callbacks run in asyncio's order (first in, first out), the order production code can rely
on; what varies from seed to seed is *when* things become ready (message and disk latencies,
faults), as in FoundationDB's simulator.

Every task is tagged with the simulated process that created it (the ``owner`` context variable,
inherited by the tasks a task creates), so a process crash cancels exactly the tasks of that
process (:meth:`SimLoop.tasks_of`).

A loop made ``pausable`` can stop a process (SIGSTOP, a frozen VM): :meth:`SimLoop.freeze` holds
back every callback of its tasks and timers (its requests' handlers, its retries, its executor
calls) until :meth:`SimLoop.thaw`, while the rest of the world goes on.

When nothing is ready and no timer is pending, the simulation can never make progress again:
``run_until_complete`` raises :class:`Stalled` (every task waits on something that will not
happen: a deadlock).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

__all__ = ["SimLoop", "Stalled", "owner"]

T = TypeVar("T")

owner: contextvars.ContextVar[object | None] = contextvars.ContextVar("onceflow_sim_owner", default=None)

START = 1_000.0  # the loop's clock at the start (seconds; an arbitrary origin)


def _as_worker() -> contextlib.AbstractContextManager[None]:
    try:
        from onceflow.storage.pgfs import as_worker
    except ImportError:  # no psycopg: no PostgreSQL store to tell
        return contextlib.nullcontext()
    return as_worker()


class Stalled(Exception):
    """Nothing is ready and no timer is pending: no task can ever run again."""


class _NoIO:
    """The selector of a loop without I/O: waiting means moving the clock to the next timer."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        if timeout is None:
            raise Stalled("no task is ready and no timer is pending")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def close(self) -> None:
        pass


class SimLoop(asyncio.BaseEventLoop):
    """See the module docstring. ``executor_delay`` says how long (simulated seconds) a function
    handed to ``run_in_executor`` takes; by default no time at all."""

    def __init__(
        self, executor_delay: Callable[[Callable[..., Any]], float] | None = None, *, pausable: bool = False
    ) -> None:
        super().__init__()
        self.pausable = pausable
        # a paused process's callbacks that came due, each with its handle (one cancelled meanwhile never runs)
        self._frozen: dict[
            object, list[tuple[asyncio.Handle, Callable[..., Any], tuple[Any, ...], contextvars.Context]]
        ] = {}
        self._now = START
        self._selector = _NoIO(self)
        self._clock_resolution = 1e-9
        self.executor_delay = executor_delay or (lambda fn: 0.0)
        self._owners: weakref.WeakKeyDictionary[asyncio.Task[Any], object] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ time

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    # ------------------------------------------------------------------ what BaseEventLoop leaves to subclasses

    def _process_events(self, event_list: list[Any]) -> None:
        pass  # no I/O: nothing ever comes from the selector

    def _write_to_self(self) -> None:
        pass  # nothing to wake: there is no other thread

    # ------------------------------------------------------------------ tasks and their owners

    def create_task(  # type: ignore[override]
        self,
        coro: Coroutine[Any, Any, T] | Generator[Any, None, T],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        task = super().create_task(coro, name=name, context=context)
        who = context.get(owner) if context is not None else owner.get()
        if who is not None:
            self._owners[task] = who
        return task

    def tasks_of(self, who: object) -> list[asyncio.Task[Any]]:
        """The unfinished tasks created by ``who`` (and by the tasks it created)."""
        return [t for t, w in list(self._owners.items()) if w is who and not t.done()]

    # ------------------------------------------------------------------ paused processes

    def freeze(self, who: object) -> None:
        """Stop process ``who``: nothing of it runs until :meth:`thaw` (the loop must be ``pausable``)."""
        assert self.pausable, "a loop made without pausable=True cannot stop a process"
        self._frozen.setdefault(who, [])

    def thaw(self, who: object) -> None:
        """Process ``who`` runs again: what came due meanwhile runs now, in the order it came due,
        but for what was cancelled before its turn (as a real loop skips a cancelled handle)."""
        for handle, callback, args, ctx in self._frozen.pop(who, []):
            super().call_soon(self._unless_cancelled, handle, callback, *args, context=ctx)

    @staticmethod
    def _unless_cancelled(handle: asyncio.Handle, callback: Callable[..., Any], *args: Any) -> None:
        if not handle.cancelled():
            callback(*args)

    def frozen(self, who: object) -> bool:
        return who in self._frozen

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., Any], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        if not self.pausable:
            return super().call_soon(callback, *args, context=context)
        ctx = context if context is not None else contextvars.copy_context()
        cell: list[asyncio.Handle] = []
        handle = super().call_soon(self._gate, ctx, cell, callback, *args, context=ctx)
        cell.append(handle)
        return handle

    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., Any], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.TimerHandle:
        if not self.pausable:
            return super().call_at(when, callback, *args, context=context)
        ctx = context if context is not None else contextvars.copy_context()
        cell: list[asyncio.Handle] = []
        handle = super().call_at(when, self._gate, ctx, cell, callback, *args, context=ctx)
        cell.append(handle)
        return handle

    def _gate(
        self, ctx: contextvars.Context, cell: list[asyncio.Handle], callback: Callable[..., Any], *args: Any
    ) -> None:
        held = self._frozen.get(ctx.get(owner)) if self._frozen else None
        if held is not None:
            held.append((cell[0], callback, args, ctx))
            return
        callback(*args)

    # ------------------------------------------------------------------ "threads"

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        fut: asyncio.Future[T] = self.create_future()

        def run() -> None:
            if fut.cancelled():
                return
            try:
                with _as_worker():  # the store bounds what the loop's own thread calls, not a worker's
                    result = func(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, as a thread pool does
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self.call_later(self.executor_delay(func), run)
        return fut
