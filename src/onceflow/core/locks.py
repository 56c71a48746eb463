"""One lock per name, kept only while someone holds it or waits for it.

The coordinator locks a transactional id (or a sink) for each request that names one, and the
subscriptions lock a subscription while they store it; the names come from requests. A table that
kept a lock for every name ever named grew with requests for ids that do not exist, which cost a
client nothing to send (issue 28). :class:`KeyedLocks` drops a name's lock when its last user
leaves, so the table holds only the names in use at this instant."""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["KeyedLocks"]


class KeyedLocks:
    """``async with locks.hold(name):`` holds the lock of ``name`` (FIFO among its waiters, as an
    :class:`asyncio.Lock`). ``len(locks)`` counts the names held or waited for."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def hold(self, name: str) -> _Hold:
        return _Hold(self, name)

    def locked(self, name: str) -> bool:
        """Whether someone holds the lock of ``name`` now."""
        entry = self._entries.get(name)
        return entry is not None and entry.lock.locked()

    def __len__(self) -> int:
        return len(self._entries)


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0  # holding it or waiting for it


class _Hold:
    __slots__ = ("_entry", "_locks", "_name")

    def __init__(self, locks: KeyedLocks, name: str) -> None:
        self._locks, self._name = locks, name
        self._entry: _Entry | None = None

    async def __aenter__(self) -> None:
        entries = self._locks._entries
        entry = entries.get(self._name)
        if entry is None:
            entry = entries[self._name] = _Entry()
        entry.users += 1
        self._entry = entry
        try:
            await entry.lock.acquire()
        except BaseException:  # cancelled while waiting: it never held the lock
            self._leave()
            raise

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._entry is not None
        self._entry.lock.release()
        self._leave()

    def _leave(self) -> None:
        entry = self._entry
        assert entry is not None
        entry.users -= 1
        if not entry.users:
            del self._locks._entries[self._name]
