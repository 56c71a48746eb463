"""The storage layer's file system, kept in PostgreSQL: the store that survives the loss of a machine.

The broker and the stream logs run unchanged on it (the same code, recovery included, as on a
local disk or the simulator's disk): every file is a row of ``onceflow_files`` and its bytes are
chunks in ``onceflow_chunks``, one chunk per sync of a file (a group commit: many appends, not a
row per message). What makes it highly available is PostgreSQL's own replication: with a
synchronous standby, a sync returns only once the standby holds the data too, so an acknowledged
append survives the loss of the primary.

Semantics, against the :class:`~onceflow.storage.fs.FileSystem` contract:

- ``pwrite`` and ``truncate`` change the file in memory; ``sync`` makes them durable in one
  database transaction (pipelined: one round trip). Until then a crash of the process loses them,
  as a power loss loses unsynced pages. A sync that fails keeps them pending: its outcome may be
  unknown (the connection broke during ``COMMIT``), so the next sync rewrites the whole pending
  range, replacing whatever of it did reach the database; it runs even when a truncation left
  nothing pending (the log's rollback of a refused append), taking such bytes out again.
- Directory operations (create, rename, remove) and ``replace_file`` are durable when they return;
  ``sync_dir`` has nothing left to do.
- Fencing: once :attr:`PgFileSystem.token` is set (the holder of the store's lease,
  server/leader.py), every writing transaction first reads the lease's token ``FOR KEY SHARE`` and
  fails with :class:`LeaseLost` if another server took the lease over since; a takeover locks the
  row ``FOR UPDATE``, which waits for those writes in flight. So a server that lost the lease can
  never write again, whatever its clocks say. The renewal (an UPDATE of no key) waits for none of
  them, and runs on connections of its own (:meth:`PgFileSystem.renew`).
- Every database error is an ``OSError`` (``EIO``), which the log treats as a failed disk: the
  append is refused, nothing half-written is served.
- A write whose answer to ``COMMIT`` was lost (a connection reset, a primary crash after its
  standby flushed) is never reported as failed without knowing: every writing transaction counts
  itself on its connection's row of ``onceflow_commits``, and after a lost answer that row is read
  back once the transaction is over (:meth:`PgFileSystem._settle`). Committed: the write returns as
  if nothing had happened. Rolled back: it fails, truly. If that cannot be learned while
  :attr:`PgFileSystem.alive` allows (a leader: while its lease is valid), it raises
  :class:`~onceflow.storage.fs.OutcomeUnknown`, and the file system refuses every later write: its
  holder's memory may disagree with the database, and it must step down.

Reads of a file's recent bytes are served from memory (the last :data:`TAIL_CACHE` bytes written);
older ranges are read from the database. A client's read of them (a catch-up read) does not hold the
event loop while it waits: :meth:`PgFile.apread` takes what memory holds at once and awaits the rest,
read by file id in a thread (:meth:`PgFileSystem.read_cold`: at most ``cold_reads`` at once, each
given at most ``read_timeout`` for its turn and as long for its answer), while the loop serves the
other clients; the log checks afterwards that the file still holds those bytes (storage/log.py,
``StreamLog.aread``). No call made on an event loop's thread waits for the
database longer than a bound, whatever the database does (a lock, a commit waiting for a lost
synchronous standby, a frozen or cut-off primary), so no database stall holds the loop, and with
it every other client, for longer (:func:`_loop_bound`): such a call runs in a thread of its own,
and the loop waits for it

- at most :attr:`PgFileSystem.read_timeout` seconds for a read (the retention sweep's segment
  headers, a create's look-ups, a fork's or a group reset's check of an offset), which then fails with
  :class:`ReadTimedOut` (nothing changed; retry); its thread gives up as soon (the pool's wait and
  each statement's ``statement_timeout``, lock waits included);
- at most :attr:`PgFileSystem.write_timeout` seconds for a write (a create, a delete, retention's
  removal of a segment), whose outcome is then unknown: it may still commit. It is
  :class:`~onceflow.storage.fs.OutcomeUnknown`, handled as a lost answer to ``COMMIT`` is (no more
  writes; the leader steps down). A write is never given a statement timeout: a ``COMMIT`` waiting
  for a synchronous standby is not ended by one (PostgreSQL turns it off before the commit), and a
  cancel would end that wait and report a commit the standby may not hold.

Calls in worker threads (recovery, the logs' syncs) wait as long as the database takes.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import queue
import re
import secrets
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

try:
    import psycopg
    from psycopg_pool import ConnectionPool, PoolTimeout
    from psycopg_pool.base import AttemptWithBackoff
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("the PostgreSQL store needs psycopg 3: pip install 'onceflow[postgresql]'") from exc

from ..errors import OnceflowError
from .fs import File, OutcomeUnknown

__all__ = ["SCHEMA", "TAIL_CACHE", "UNKNOWN", "Connector", "LeaseLost", "PgFile", "PgFileSystem", "ReadTimedOut"]

log = logging.getLogger("onceflow.storage")

TAIL_CACHE = 1 << 20  # bytes of a file's end kept in memory for reads
RECONNECT_MAX = 0.5  # seconds: the longest the store's pool waits between attempts to reconnect
UNKNOWN = -1  # what a file's size in the database is after a sync that failed

_TABLES = """
CREATE TABLE IF NOT EXISTS onceflow_files (
    path   text PRIMARY KEY,
    parent text NOT NULL,
    id     bigint UNIQUE,              -- NULL for a directory
    size   bigint NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS onceflow_files_parent ON onceflow_files (parent);
CREATE SEQUENCE IF NOT EXISTS onceflow_file_ids;
CREATE TABLE IF NOT EXISTS onceflow_chunks (
    file bigint NOT NULL,
    at   bigint NOT NULL,
    data bytea  NOT NULL,
    PRIMARY KEY (file, at)
);
"""
_COMPRESSION = """
-- lz4 where the server has it (PostgreSQL 14+ built with it): a sync's chunk is compressed several
-- times faster than with the default pglz, which bounded the producer's throughput
DO $$ BEGIN
    IF (SELECT attcompression FROM pg_attribute
        WHERE attrelid = 'onceflow_chunks'::regclass AND attname = 'data') IS DISTINCT FROM 'l' THEN
        EXECUTE 'ALTER TABLE onceflow_chunks ALTER COLUMN data SET COMPRESSION lz4';
    END IF;
EXCEPTION WHEN OTHERS THEN NULL;  -- an older server, or one without lz4: the default stays
END $$;
"""
_LEASE = """
CREATE TABLE IF NOT EXISTS onceflow_lease (
    id      int PRIMARY KEY CHECK (id = 1),
    token   bigint NOT NULL,
    holder  text NOT NULL,
    address text,
    expires timestamptz NOT NULL,
    session text                       -- the holder's connections' application_name: onceflow/<session>
);
"""
# the holder says its term in its name, written with its token (``<name> term=<seconds>``): a server
# from before that, which says nothing, had 10 s by default
LEGACY_TERM = 10.0
_TERM_IN_NAME = re.compile(r" term=([0-9.]+)$")
_COMMITS = """
CREATE TABLE IF NOT EXISTS onceflow_commits (
    conn    bigint PRIMARY KEY,        -- one connection of a server (a random id, set in its session)
    session text NOT NULL,             -- that server's session (its connections' application_name)
    seq     bigint NOT NULL            -- how many writing transactions of the connection committed
);
"""
_CLUSTER = """
CREATE TABLE IF NOT EXISTS onceflow_cluster (
    id     int PRIMARY KEY CHECK (id = 1),
    secret bytea NOT NULL              -- what the servers seal the headers they pass on with (server/leader.py)
);
"""
SCHEMA = _TABLES + _COMPRESSION + _LEASE + _COMMITS + _CLUSTER
# what a store made by an earlier version gains at a start: no statement of it waits for a table's
# lock, and none needs a privilege the store's tables do not (CREATE TABLE IF NOT EXISTS checks CREATE
# on the schema even when the table is there: a role with data access only could not start)
_UPGRADE = (
    _COMPRESSION
    + """
DO $$ BEGIN
    IF to_regclass('onceflow_cluster') IS NULL THEN
        EXECUTE $t$"""
    + _CLUSTER.strip().rstrip(";")
    + """$t$;
    END IF;
END $$;
"""
)
_SCHEMA_OBJECTS = (
    "onceflow_files",
    "onceflow_files_parent",
    "onceflow_file_ids",
    "onceflow_chunks",
    "onceflow_lease",
    "onceflow_commits",
)
# a takeover of the lease (its row locked FOR UPDATE first): a new token, fencing every earlier holder
_TAKE = (
    "UPDATE onceflow_lease SET token = token + 1, holder = %(h)s, address = %(a)s, "
    "expires = clock_timestamp() + make_interval(secs => %(t)s), session = %(s)s "
    "WHERE id = 1 RETURNING token"
)
# every writing transaction counts itself on its connection's row, first: when the answer to its
# COMMIT is lost, that count, read back once the transaction is over, says whether it committed
_MARK = (
    "UPDATE onceflow_commits SET seq = seq + 1 WHERE conn = current_setting('onceflow.conn')::bigint "
    "RETURNING conn, seq"
)


class LeaseLost(OnceflowError, OSError):
    """Another server holds the store's lease now: this one may not write (an ``OSError``, ``EIO``,
    so that the log handles it as a failed write)."""

    def __init__(self, mine: int, now: int | None) -> None:
        message = f"another onceflow server took over the store (lease token {now}, this server holds {mine})"
        super().__init__(message, code="lease_lost")
        self.errno = errno.EIO
        self.strerror = message


class ReadTimedOut(OnceflowError, OSError):
    """A read made on the event loop did not get its answer within the store's ``read_timeout``
    (no free connection, or the statement was cancelled by its ``statement_timeout``): the
    database is stalled or overloaded. Nothing changed; the same read may succeed later (an
    ``OSError``, ``ETIMEDOUT``; the server answers it 503 with ``Retry-After``)."""

    retriable = True

    def __init__(self, what: str, seconds: float) -> None:
        message = (
            f"PostgreSQL store: the {what} got no answer within its read_timeout ({seconds:g} s) "
            "and was given up; the database is stalled or overloaded"
        )
        super().__init__(message, code="store_read_timeout")
        self.errno = errno.ETIMEDOUT
        self.strerror = message


def _on_loop() -> bool:
    """Whether the calling thread runs an event loop (a read there holds up every other task), and
    not a worker's call on its behalf (:func:`as_worker`)."""
    if getattr(_CALL, "worker", False):
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_CALL = threading.local()  # .bounded: this thread runs a call the event loop waits for (Connector.bounded)
# .worker: it runs an executor's work, on the loop's own thread (the simulator's executor does)


@contextmanager
def as_worker() -> Iterator[None]:
    """Calls made in the block count as a worker thread's, not the event loop's: for an executor
    that runs its work on the loop's own thread (the simulator's), so that the store bounds the
    same calls as when threads run them."""
    was = getattr(_CALL, "worker", False)
    _CALL.worker = True
    try:
        yield
    finally:
        _CALL.worker = was


def _bounded() -> bool:
    """Whether a wait in this thread holds up an event loop: the loop's own thread, or a call the loop
    waits for (:meth:`Connector.bounded`)."""
    return bool(getattr(_CALL, "bounded", False)) or _on_loop()


class Overran(OnceflowError):
    """:meth:`Connector.bounded`: the call did not return within its bound (it may still be running)."""


_Method = TypeVar("_Method", bound=Callable[..., Any])
_T = TypeVar("_T")


def _loop_bound(kind: Literal["read", "write", "open"]) -> Callable[[_Method], _Method]:
    """A call into the database made on an event loop's thread runs in a thread of its own, and the
    loop waits for it at most the store's ``read_timeout`` (a read) or ``write_timeout`` (a write;
    ``open``: a write with ``create=True``), whatever the database does: a statement_timeout does
    not end a commit that waits for a synchronous standby, nor a query to a database that is frozen
    (SIGSTOP, a paused VM) or cut off, and no client would be served meanwhile
    (:meth:`PgFileSystem._off_loop` says what a call that overran is)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def run(self: PgFileSystem, *args: Any, **kwargs: Any) -> Any:
            if not _on_loop() or getattr(_CALL, "bounded", False):
                return method(self, *args, **kwargs)
            write = kind == "write" or (kind == "open" and bool(kwargs.get("create")))
            what = f"{method.__name__.strip('_')} {args[0]}" if args else method.__name__.strip("_")
            return self._off_loop(functools.partial(method, self, *args, **kwargs), what, write=write)

        return run  # type: ignore[return-value]

    return wrap


def _io_error(exc: Exception, what: str) -> OSError:
    return OSError(errno.EIO, f"PostgreSQL store: {what} failed: {exc}")


def _configure(conn: Any, *, idle_ms: int, session: str) -> None:
    """Each connection's session: a transaction left open by a process that stopped (SIGSTOP, a
    pause) is ended by the database after ``idle_ms``, so that the lease's row lock it holds does
    not keep the next leader out for as long as the pause lasts; the connection is named
    ``onceflow/<session>``, so that the next leader can end those of a holder stopped in the middle
    of a statement (:meth:`PgFileSystem.acquire`); and it gets its row of ``onceflow_commits``,
    whose count its writing transactions move (:data:`_MARK`, :meth:`PgFileSystem._settle`)."""
    conn.execute(f"SET idle_in_transaction_session_timeout = {idle_ms}")
    conn.execute(f"SET application_name = 'onceflow/{session}'")
    ident = secrets.randbits(63)
    conn.execute("INSERT INTO onceflow_commits (conn, session, seq) VALUES (%s, %s, 0)", (ident, session))
    conn.execute("SELECT set_config('onceflow.conn', %s, false)", (str(ident),))
    conn.commit()


class _Attempt(AttemptWithBackoff):
    """psycopg_pool's back-off between attempts to replace a lost connection, capped at
    :data:`RECONNECT_MAX`. Its own doubles from 1 s (1, 2, 4, 8 s...): after a database failover
    of a few seconds the leader kept its lease (renewals have connections of their own) but its
    writes waited up to 4 s more for the pool's next attempt (docs/reliability.md)."""

    INITIAL_DELAY = 0.1

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_MAX)


class _Pool(ConnectionPool):
    """The store's pool: reconnects at most :data:`RECONNECT_MAX` apart (:class:`_Attempt`).
    psycopg_pool gives no parameter for it; it makes its attempt object in ``_add_connection``
    when given none, so this one gives it (tests/storage/test_pgfs_reconnect.py checks it holds)."""

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        super()._add_connection(attempt or _Attempt(timeout=self.reconnect_timeout), growing)


class Connector:
    """How :class:`PgFileSystem` reaches its database: psycopg's connections and psycopg_pool's
    pool. The simulator gives a database of its own here (tools/onceflow_tools/sim/pg.py), which
    speaks the same calls and the same SQL."""

    def connect(self, conninfo: str, **kwargs: Any) -> Any:
        return psycopg.connect(conninfo, **kwargs)

    def pool(self, conninfo: str, **kwargs: Any) -> Any:
        return _Pool(conninfo, **kwargs)

    def bounded(self, call: Callable[[], Any], seconds: float) -> Any:
        """``call()`` in another thread (:class:`_CallThreads`), waiting for it at most ``seconds``;
        :class:`Overran` past them (the call goes on, and its connection goes back to the pool when
        it ends). A read's waits in that thread are bounded in turn (:func:`_bounded`: the pool's
        wait, each statement's ``statement_timeout``), so one that overran does not linger for long;
        a write's commit is given no bound (the module docstring)."""
        return _THREADS.run(call, seconds)


class _CallThreads:
    """Daemon threads (one stuck in a frozen database never holds up the process's exit) that run
    calls for event loops, kept for the next call once done (a thread's start costs more than the
    hand-over): as many as calls run at once, at most :attr:`KEEP` kept idle."""

    KEEP = 8

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list[Any]]]] = []
        self._lock = threading.Lock()

    def run(self, call: Callable[[], Any], seconds: float) -> Any:
        done = threading.Event()
        box: list[tuple[bool, Any]] = []  # (returned, its value or what it raised)
        self.start(call, done, box)
        if not done.wait(seconds):
            raise Overran
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def start(self, call: Callable[[], Any], done: threading.Event, box: list[Any]) -> None:
        """Hand ``call`` to a kept thread (a new one if none is idle) and return at once: ``box``
        gets ``(True, its value)`` or ``(False, what it raised)``, then ``done`` is set."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="onceflow-store-call", daemon=True).start()
        inbox.put((call, done, box))

    def _serve(self, inbox: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list[Any]]]) -> None:
        _CALL.bounded = True
        while True:
            call, done, box = inbox.get()
            try:
                box.append((True, call()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box.append((False, exc))
            finally:
                done.set()
            del call, done, box  # nothing of a finished call is kept while idle
            with self._lock:
                if len(self._idle) >= self.KEEP:
                    return
                self._idle.append(inbox)


_THREADS = _CallThreads()


class _BoundedCalls(Executor):
    """An executor over :data:`_THREADS` (``loop.run_in_executor``): each call runs in a kept
    daemon thread that counts as one the event loop waits for, so the store bounds its waits as
    it bounds a call made on the loop's thread (:func:`_bounded`: the pool's wait and each
    statement at most ``read_timeout``), and a thread stuck in a frozen database never holds up
    the process's exit. It bounds nothing itself: its caller does (:meth:`PgFileSystem.read_cold`)."""

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        fut: Future[_T] = Future()
        if not fut.set_running_or_notify_cancel():
            return fut
        done = threading.Event()
        box: list[Any] = []

        def call() -> None:
            try:
                value = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        _THREADS.start(call, done, box)
        return fut


_BOUNDED_CALLS = _BoundedCalls()


class _Gone(Exception):
    """Rolls back a sync of a file removed meanwhile."""


def _rollback(conn: Any) -> None:
    try:
        conn.rollback()
    except psycopg.Error:  # the connection broke: the database rolls the transaction back itself
        pass


def _parent(path: str) -> str:
    return str(Path(path).parent)


class PgFile:
    """An open file of :class:`PgFileSystem` (see the module docstring). Thread-safe."""

    def __init__(self, fs: PgFileSystem, path: Path, ident: int, size: int) -> None:
        self._fs = fs
        self.path = path
        self.id = ident
        self._lock = threading.Lock()
        self._size = size  # what the file holds now, pending changes included
        self._durable = size  # what the database holds (UNKNOWN after a sync that failed)
        self._from = size  # the pending range starts here: bytes [_from, _size) are in _pending
        self._pending = bytearray()
        self._cache_from = size  # bytes [_cache_from, _from) are cached (durable and recent)
        self._cache = bytearray()
        self.closed = False
        self._sync_lock = threading.Lock()
        self._syncing = -1  # while a sync runs: the end of what it writes
        self._overtaken = False  # bytes below _syncing changed while it ran

    def __repr__(self) -> str:
        return f"<pg file {self.path} id={self.id} size={self._size}>"

    def size(self) -> int:
        return self._size

    def pwrite(self, data: bytes, at: int) -> None:
        if at < 0:
            raise OSError(errno.EINVAL, "negative offset", str(self.path))
        with self._lock:
            self._check()
            end = at + len(data)
            if at < self._syncing:
                self._overtaken = True
            if at < self._from:  # rewrites durable bytes: the pending range starts at ``at`` now
                keep = self._durable_bytes(end, self._from - end) if end < self._from else b""
                self._pending[0:0] = bytes(min(end, self._from) - at) + keep
                self._drop_cache_from(at)
                self._from = at
            if at > self._size:  # a hole reads as zeros
                self._pending += bytes(at - self._size)
                self._size = at
            i = at - self._from
            self._pending[i : i + len(data)] = data
            self._size = max(self._size, end)

    def truncate(self, size: int) -> None:
        with self._lock:
            self._check()
            if size < self._syncing:
                self._overtaken = True
            if size < self._from:
                self._drop_cache_from(size)
                self._from = size
                self._pending.clear()
            elif size - self._from < len(self._pending):
                del self._pending[size - self._from :]
            else:
                self._pending += bytes(size - self._from - len(self._pending))
            self._size = size

    def pread(self, n: int, at: int) -> bytes:
        cold, tail = self._split(n, at)
        if not cold:
            return tail
        # older bytes come from the database, without the file's lock: they are durable, and a sync
        # running meanwhile writes only above them
        return self._from_database(at, cold) + tail

    async def apread(self, n: int, at: int) -> bytes:
        """:meth:`pread` for an event loop: the same bytes. What memory holds is taken at once; bytes
        older than that are read from the database in a thread (:meth:`PgFileSystem.read_cold`: at
        most ``cold_reads`` at once, each waited for at most ``read_timeout``) while the loop serves
        others. Without a cold part it returns without awaiting anything.

        The caller must know the file still holds those bytes when this returns (the log checks that
        the segment is still its own): a file removed meanwhile (retention, a deleted stream) may
        read as zeros, as a shortened one does."""
        cold, tail = self._split(n, at)
        if not cold:
            return tail
        return await self._fs.read_cold(self, at, cold) + tail

    def _split(self, n: int, at: int) -> tuple[int, bytes]:
        """Bytes [at, at + n) as :meth:`pread` returns them, in two parts: how many of the first
        must come from the database (0: none), and the bytes memory holds after them (taken now)."""
        with self._lock:
            self._check()
            end = min(at + n, self._size)
            if at >= end:
                return 0, b""
            upto = max(at, min(end, self._cache_from))
            return upto - at, self._in_memory(upto, end)

    def _in_memory(self, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) from the cache and the pending bytes (which follow it); lo >= _cache_from."""
        if lo >= hi:
            return b""
        if lo >= self._from:
            return bytes(self._pending[lo - self._from : hi - self._from])
        cached = bytes(self._cache[lo - self._cache_from : min(hi, self._from) - self._cache_from])
        return cached + bytes(self._pending[: hi - self._from]) if hi > self._from else cached

    def sync(self) -> None:
        """Make the pending changes durable. The database transaction runs without the file's lock:
        reads (and writes past what is being synced) go on meanwhile, so a sync stuck in the database
        (a failover) stalls no reader."""
        with self._sync_lock:  # one sync of the file at a time
            with self._lock:
                self._check()
                if self._from == self._durable == self._size:
                    return
                start, data, size = self._from, bytes(self._pending), self._size
                self._syncing, self._overtaken = size, False
            try:
                self._fs.write_range(self, start, data, size)
            except BaseException:
                with self._lock:  # its COMMIT may have landed: the next sync runs, even with nothing pending
                    self._durable = UNKNOWN
                raise
            finally:
                with self._lock:
                    self._syncing = -1
            with self._lock:
                self._durable = size  # what the database holds now
                if self._overtaken:
                    # bytes below what was synced changed meanwhile (a truncation, a rewrite): they stay
                    # pending, and the next sync writes them over what this one wrote
                    return
                # the synced bytes are the head of the pending ones: they join the cache of the file's end
                if self._cache_from + len(self._cache) != start:
                    self._cache_from, self._cache = start, bytearray()
                before = len(self._cache)
                self._cache += data
                if len(self._cache) > TAIL_CACHE:
                    cut = len(self._cache) - TAIL_CACHE
                    del self._cache[:cut]
                    self._cache_from += cut
                self._from = size
                del self._pending[: len(data)]
                grew = len(self._cache) - before
        self._fs.cached(self, grew)

    def drop_cache(self) -> bool:
        """Forget the cached bytes (reads go to the database). Skipped (False) if the file is busy:
        the caller may hold another file's lock, and waiting here could deadlock."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._cache_from, self._cache = self._from, bytearray()
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        self.closed = True  # first: a sync finishing meanwhile then leaves the budget alone
        self._cache_from, self._cache = self._from, bytearray()
        self._fs.forget(self)

    def _check(self) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "file handle is closed", str(self.path))

    def _drop_cache_from(self, at: int) -> None:
        if at <= self._cache_from:
            self._cache_from, self._cache = at, bytearray()
        elif at < self._cache_from + len(self._cache):
            del self._cache[at - self._cache_from :]

    def _durable_bytes(self, at: int, n: int) -> bytes:
        """Bytes [at, at + n) below the pending range: from the cache, else the database."""
        if at >= self._cache_from:
            return bytes(self._cache[at - self._cache_from : at - self._cache_from + n])
        return self._from_database(at, n)

    def _from_database(self, at: int, n: int) -> bytes:
        """Bytes [at, at + n) as the database holds them. Touches nothing of the file but its id
        (fixed): safe in any thread."""
        got = self._fs.read_range(self.id, at, n)
        if len(got) < n:  # a hole (or a file another server shortened): zeros, as a sparse file reads
            got += bytes(n - len(got))
        return got


class _Preload:
    """A tree of the store read at once (:meth:`PgFileSystem.preloaded`): every file's and
    directory's row, and the bytes of the small files. Recovery reads each stream's metadata,
    snapshot and segment list: a dozen round trips a stream, minutes for ten thousand of them."""

    def __init__(self, root: str, rows: list[tuple[str, str, int | None, int]], data: dict[int, bytes]) -> None:
        self.root = root
        self.files: dict[str, tuple[int | None, int]] = {}
        self.children: dict[str, list[str]] = {}
        for path, parent, ident, size in rows:
            self.files[path] = (ident, size)
            if path != parent:
                self.children.setdefault(parent, []).append(Path(path).name)
        self.data = data
        self.deferred: dict[str, bytes] = {}  # whole-file replacements written when the block ends
        self.failed: BaseException | None = None  # writing them failed: the block raises it at its end

    def covers(self, key: str) -> bool:
        return key == self.root or key.startswith(self.root + "/")

    def file(self, key: str) -> tuple[int, int]:
        """The id and size of the file ``key``, raising as the database's answer would."""
        found = self.files.get(key)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        if found[0] is None:
            raise IsADirectoryError(errno.EISDIR, "is a directory", key)
        return found[0], found[1]


class PgFileSystem:
    """A :class:`~onceflow.storage.fs.FileSystem` in a PostgreSQL database (module docstring).

    ``conninfo`` is any libpq connection string or URL (multi-host ones included). ``pool_size``
    bounds the connections: the storage layer's worker threads each take one per operation.
    ``cold_reads``: how many reads for an event loop's clients may wait for the database at once
    (:meth:`read_cold`); the pool has that many connections more, so that they never take one the
    writes need. ``connector``, ``clock`` (monotonic seconds) and ``sleep`` are the database and
    the time it runs on: the simulator's, in a simulation."""

    def __init__(
        self,
        conninfo: str,
        *,
        pool_size: int = 8,
        connect_timeout: float = 10.0,
        cache_budget: int = 256 << 20,
        idle_timeout: float = 5.0,
        read_timeout: float = 2.0,
        write_timeout: float = 5.0,
        cold_reads: int = 4,
        connector: Connector | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if cold_reads < 1:
            raise ValueError("cold_reads must be at least 1")
        self.conninfo = conninfo
        self._connector = connector or Connector()
        self._clock = clock  # judges the lease's holder gone (acquire) and paces read-backs (_settle)
        self._sleep = sleep
        # how long a read on the event loop may wait: for a connection, and for each statement
        self.read_timeout = read_timeout
        # how long the event loop waits for a write made on its thread (a create, a delete, a small
        # file): past it the write's outcome is unknown (_off_loop)
        self.write_timeout = write_timeout
        self.token: int | None = None  # the lease this server holds; None: no fencing (tests, tools)
        self.session = uuid.uuid4().hex[:16]  # names this process's connections (application_name)
        self.connect_timeout = connect_timeout
        # while this says yes, a write whose COMMIT answer was lost keeps trying to learn what became
        # of it; the leader sets it to its lease's validity (None: for ``connect_timeout`` seconds)
        self.alive: Callable[[], bool] | None = None
        self.unsure: str | None = None  # set when a write's outcome stayed unknown: no more writes
        self.on_unsure: Callable[[str], None] | None = None  # told once, from the writing thread
        self._idle_ms = max(1, int(idle_timeout * 1000))
        self._seen: tuple[tuple[int, str], float] | None = None  # the lease's row as first seen so (acquire)
        self._lease_conns: list[Any] = []  # the renewals' own connections, idle
        self._pre: _Preload | None = None  # a tree read at once, while recovery reads it (preloaded)
        self._pre_lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._create_schema()  # before the pool: each of its connections registers in onceflow_commits
        self._pool = self._connector.pool(
            conninfo,
            min_size=1,
            max_size=pool_size + cold_reads,
            open=False,
            timeout=connect_timeout,
            kwargs={"autocommit": False},
            check=ConnectionPool.check_connection,
            configure=functools.partial(_configure, idle_ms=max(1, int(idle_timeout * 1000)), session=self.session),
            name="onceflow-store",
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
        except BaseException:  # its workers would go on connecting: a caller may try again
            self._pool.close()
            raise
        self.cache_budget = cache_budget
        self.cold_reads = cold_reads
        # read_cold's turns, one set per event loop (an asyncio.Semaphore belongs to one loop)
        self._turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.cold_running = 0  # read_cold: reads in a thread now (their turn is taken until they end)
        self.cold_waiting = 0  # read_cold: reads waiting for a turn
        self._cached: OrderedDict[PgFile, int] = OrderedDict()  # files' cached bytes, least recent first
        self._cache_total = 0
        self._cache_lock = threading.Lock()

    def _connect(self, **settings: Any) -> Any:
        """A connection of its own, outside the pool (whose back-off after a failure is seconds),
        whose transactions a pause of this process does not leave open (as the pool's)."""
        conn = self._connector.connect(
            self.conninfo,
            autocommit=False,
            connect_timeout=max(1, round(self.connect_timeout)),
            application_name=f"onceflow/{self.session}",
            **settings,
        )
        try:  # as the pool's connections (_configure), not through ``options``: the user's stay theirs
            conn.execute(f"SET idle_in_transaction_session_timeout = {self._idle_ms}")
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def _create_schema(self) -> None:
        try:
            with self._connect() as conn, conn.cursor() as cur:
                cur.execute(f"SELECT {' AND '.join(f'to_regclass({n!r}) IS NOT NULL' for n in _SCHEMA_OBJECTS)}")
                if not cur.fetchone()[0]:
                    cur.execute("SELECT pg_advisory_xact_lock(4437001)")  # concurrent first starts: one creates
                    cur.execute(SCHEMA)
                else:
                    # the store exists: nothing that may wait for a table's lock, for such a wait holds
                    # up every write after it (CREATE ... IF NOT EXISTS locks a table even when it
                    # exists); lz4 for a store made before it is tried, and given up at once if busy
                    cur.execute("SET LOCAL lock_timeout = '100ms'")
                    cur.execute(_UPGRADE)
                conn.commit()
        except psycopg.Error as exc:
            raise _io_error(exc, "create the schema") from exc

    def cluster_secret(self) -> bytes:
        """The secret the servers of this store share (server/leader.py's ``Seal``): 32 random bytes,
        made by the first server that asks. Whoever can read the database can read them; nobody else
        can."""
        try:
            with self._connect() as conn, conn.cursor() as cur:
                cur.execute(
                    "INSERT INTO onceflow_cluster (id, secret) VALUES (1, %s) ON CONFLICT (id) DO NOTHING",
                    (secrets.token_bytes(32),),
                )
                cur.execute("SELECT secret FROM onceflow_cluster WHERE id = 1")
                row = cur.fetchone()
                conn.commit()
        except psycopg.Error as exc:
            raise _io_error(exc, "read the servers' shared secret") from exc
        assert row is not None
        return bytes(row[0])

    def close(self) -> None:
        self._pool.close()
        with self._lease_lock:
            conns, self._lease_conns = self._lease_conns, []
        for conn in conns:
            conn.close()

    def cached(self, f: PgFile, grew: int) -> None:
        """Account ``f``'s cache growing by ``grew`` bytes (an upper bound: a truncation shrinks
        it unaccounted); over the budget, the least recently written files' caches are dropped
        (their reads go to the database)."""
        with self._cache_lock:
            if f.closed:  # closed while it synced (a stream deleted meanwhile): forgotten already
                return
            self._cached[f] = self._cached.pop(f, 0) + grew
            self._cache_total += grew
            over = self._cache_total - self.cache_budget
            victims = []
            for victim, n in self._cached.items():
                if over <= 0 or victim is f:
                    break
                victims.append(victim)
                over -= n
        for victim in victims:
            if victim.drop_cache():
                self.forget(victim)

    def forget(self, f: PgFile) -> None:
        """``f``'s cache is gone (dropped, or the file closed)."""
        with self._cache_lock:
            self._cache_total -= self._cached.pop(f, 0)

    # ------------------------------------------------------------------ the lease (server/leader.py)

    def acquire(self, holder: str, address: str | None, ttl: float) -> int | None:
        """Take the store's lease if nobody holds it: the new token, which fences every earlier
        holder's writes; None if it is held. Called again and again by a follower.

        Whether the holder is gone is judged by this process's own clock, never by the database's
        (which may jump): the lease is free once its row (its token and row version: every renewal
        writes a new one) stayed the same for ``ttl`` seconds of :func:`time.monotonic` since this
        process first saw it so, or at once when its holder released it. The holder stops serving
        0.8 of a term after its last renewal *began* by its own clock, before that renewal could be
        seen here: so the assumption is clocks that run at about the same *rate* (within 20 %),
        not clocks that agree. The holder says its term in its name, which it writes with its
        token (so a later holder that says nothing never inherits it): a follower waits the longer
        of its own and the holder's (:data:`LEGACY_TERM` for a holder that does not say).

        Taking it locks the row ``FOR UPDATE`` first: that waits for the holder's writes in flight
        (each holds the row ``FOR KEY SHARE`` until it commits, having read the token), so none of
        them commits after the token moved; writes that come later read the new token and fail."""
        with self._tx("read the lease", fence=False) as cur:
            cur.execute("SELECT token, xmin::text, expires = '-infinity', holder FROM onceflow_lease WHERE id = 1")
            row = cur.fetchone()
        # after the read: what it saw was committed before now, so a renewal it saw began before now
        now = self._clock()
        named = {"h": f"{holder} term={ttl:g}", "a": address, "t": ttl, "s": self.session}
        if row is None:
            with self._tx("take the lease", fence=False) as cur:
                cur.execute(
                    "INSERT INTO onceflow_lease (id, token, holder, address, expires, session) "
                    "VALUES (1, 1, %(h)s, %(a)s, clock_timestamp() + make_interval(secs => %(t)s), %(s)s) "
                    "ON CONFLICT (id) DO NOTHING RETURNING token",
                    named,
                )
                got = cur.fetchone()
            if got is None:
                return None
            self._forget_dead_sessions()
            return int(got[0])
        version = (int(row[0]), str(row[1]))
        if not row[2]:  # held: free only once it stayed unchanged for a term of this clock
            if self._seen is None or self._seen[0] != version:
                self._seen = (version, now)
                return None
            # the holder's term, if longer (servers configured otherwise, or from before it was said)
            said = _TERM_IN_NAME.search(str(row[3]))
            if now - self._seen[1] < max(ttl, float(said.group(1)) if said else LEGACY_TERM):
                return None
        try:
            with self._tx("take the lease", fence=False) as cur:
                # the holder's writes hold the row FOR KEY SHARE for milliseconds; waiting longer means
                # it is stopped inside one, and that is dealt with below
                cur.execute(f"SET LOCAL lock_timeout = {max(50, min(1000, int(ttl * 250)))}")
                cur.execute("SELECT token, xmin::text FROM onceflow_lease WHERE id = 1 FOR UPDATE")
                locked = cur.fetchone()
                if locked is None or (int(locked[0]), str(locked[1])) != version:
                    return None  # renewed, released or taken meanwhile: look again
                cur.execute(_TAKE, named)
                got = cur.fetchone()
            self._seen = None
            self._forget_dead_sessions()
            return int(got[0])
        except OSError as exc:
            if not isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
                raise
        self._end_stopped_holder(version[0])
        return None

    def _forget_dead_sessions(self) -> None:
        """Remove the ``onceflow_commits`` rows of servers with no connection left (best effort, by
        a new leader). A server whose row went can no longer read back a lost COMMIT answer: it
        learns its outcome is unknown and stops writing, which a deposed server must do anyway."""
        try:
            with self._tx("forget the commit counts of servers that are gone", fence=False) as cur:
                cur.execute(
                    "DELETE FROM onceflow_commits c WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a "
                    "WHERE a.application_name = 'onceflow/' || c.session)"
                )
        except OSError as exc:
            log.warning("could not forget the commit counts of servers that are gone: %s", exc)

    def _end_stopped_holder(self, token: int) -> None:
        """The lease's row stays locked by its holder's transaction although it renewed nothing for
        a term: it is stopped inside a statement (SIGSTOP, a frozen VM: its session is 'active',
        which ``idle_in_transaction_session_timeout`` does not end). End its sessions, and the lock
        goes with them. It leads no more (its own clock tells it so when it resumes), and what it
        was writing was never acknowledged (or is read back as committed, storage/pgfs.py)."""
        with self._tx("end the sessions of the lease's stopped holder", fence=False) as cur:
            cur.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid)) FROM pg_stat_activity a "
                "JOIN onceflow_lease l ON l.id = 1 AND l.token = %s "
                "AND a.application_name = 'onceflow/' || l.session WHERE a.pid <> pg_backend_pid()",
                (token,),
            )
            row = cur.fetchone()
        if row and row[0]:
            log.warning("ended %d database sessions of the store's previous leader: its term ran out", row[0])

    def renew(self, token: int, ttl: float) -> bool:
        """Extend the lease ``token`` holds; False if another server holds it now, or it was
        released (a renewal in flight at a clean stop must not take the release back).

        On a connection of its own, never one of the pool's (busy with the leader's writes, or
        backing off after a failure): a renewal waits for nothing of the leader's own load. Its
        UPDATE does not wait for the writes' ``FOR KEY SHARE`` locks either (it changes no key).
        Several may run at once (a hung one does not hold up the next): each takes its own. A kept
        connection that died meanwhile (a database restart) is replaced at once, in the same try."""
        with self._lease_lock:
            conn = self._lease_conns.pop() if self._lease_conns else None
        for fresh in (conn is None, True):
            try:
                if fresh:
                    conn = self._connect()
                    conn.execute(f"SET statement_timeout = {max(500, int(ttl * 1000 / 3))}")
                    conn.commit()
                assert conn is not None
                cur = conn.execute(
                    "UPDATE onceflow_lease SET expires = clock_timestamp() + make_interval(secs => %s) "
                    "WHERE id = 1 AND token = %s AND expires > '-infinity'",
                    (ttl, token),
                )
                renewed = bool(cur.rowcount)
                conn.commit()
                break
            except psycopg.Error as exc:
                if conn is not None:
                    conn.close()
                conn = None
                if fresh:
                    raise _io_error(exc, "renew the lease") from exc
        with self._lease_lock:
            self._lease_conns.append(conn)
        return renewed

    @_loop_bound("write")
    def release(self, token: int) -> None:
        """Give the lease up at once (a clean shutdown): another server need not wait for it to expire."""
        with self._tx("release the lease", fence=False) as cur:
            cur.execute(
                "UPDATE onceflow_lease SET expires = '-infinity' WHERE id = 1 AND token = %s",
                (token,),
            )

    @_loop_bound("read")
    def holder(self) -> tuple[str, str | None, int] | None:
        """Who holds the lease (holder, address, token), if anyone does."""
        with self._tx("read the lease", fence=False) as cur:
            # by the database's clock: only where to send requests, never whether to serve
            cur.execute(
                "SELECT holder, address, token FROM onceflow_lease WHERE id = 1 AND expires >= clock_timestamp()"
            )
            row = cur.fetchone()
        return None if row is None else (str(row[0]), row[1], int(row[2]))

    # ------------------------------------------------------------------ transactions

    @contextmanager
    def _tx(self, what: str, *, fence: bool = True, read: bool = False) -> Iterator[Any]:
        """A transaction, committed when the block ends. ``fence``: a write of the store's content,
        counted (:data:`_MARK`: a lost answer to its COMMIT is resolved by :meth:`_settle`) and
        fenced by the lease's token; else a read, or a write of the lease itself. ``read``: it only
        reads; on an event loop's thread it is then bounded by :attr:`read_timeout` (the module
        docstring), raising :class:`ReadTimedOut` past it."""
        if fence:
            self._refuse_if_unsure(what)
        held = _bounded()
        bound = self.read_timeout if read and not fence and held else None
        wait = bound if bound is not None else (self.write_timeout if held else None)
        try:
            # the wait for a connection: at most read_timeout (write_timeout) when it holds up an
            # event loop, else connect_timeout
            with self._pool.connection(timeout=wait) as conn:
                if fence:  # an earlier write's outcome became unknown while this one waited
                    self._refuse_if_unsure(what)
                mark = None
                try:
                    with conn.cursor() as cur:
                        if bound is not None:  # each statement of this read: at most read_timeout
                            cur.execute(f"SET LOCAL statement_timeout = {max(1, int(bound * 1000))}")
                        if fence:
                            cur.execute(_MARK)
                            mark = self._marked(cur)
                            if self.token is not None:
                                cur.execute("SELECT token FROM onceflow_lease WHERE id = 1 FOR KEY SHARE")
                                self._lease_verify(cur)
                        yield cur
                except BaseException:
                    _rollback(conn)
                    raise
                self._commit(conn, mark, what)
        except (psycopg.errors.QueryCanceled, PoolTimeout) as exc:
            if bound is None:
                raise _io_error(exc, what) from exc
            raise ReadTimedOut(what, bound) from exc
        except psycopg.Error as exc:
            raise _io_error(exc, what) from exc

    @_loop_bound("write")
    def write_range(self, f: PgFile, start: int, data: bytes, size: int) -> None:
        """Make the file's bytes from ``start`` on be ``data`` and its size ``size``, durably: one
        transaction, its statements pipelined (one round trip before the commit's)."""
        what = f"sync of {f.path}"
        self._refuse_if_unsure(what)
        try:
            with self._pool.connection() as conn:
                self._refuse_if_unsure(what)  # an earlier write's outcome became unknown while this one waited
                try:
                    with conn.pipeline():
                        marked = conn.execute(_MARK)
                        lease = self._lease_check(conn)
                        conn.execute("DELETE FROM onceflow_chunks WHERE file = %s AND at >= %s", (f.id, start))
                        conn.execute(
                            "UPDATE onceflow_chunks SET data = substring(data FROM 1 FOR (%s - at)::int) "
                            "WHERE file = %s AND at = "
                            "(SELECT max(at) FROM onceflow_chunks WHERE file = %s AND at < %s) "
                            "AND at + length(data) > %s",
                            (start, f.id, f.id, start, start),
                        )
                        if data:
                            conn.execute(
                                "INSERT INTO onceflow_chunks (file, at, data) VALUES (%s, %s, %s)", (f.id, start, data)
                            )
                        sized = conn.execute("UPDATE onceflow_files SET size = %s WHERE id = %s", (size, f.id))
                    mark = self._marked(marked)
                    self._lease_verify(lease)
                    if sized.rowcount == 0:  # removed meanwhile: like a write to an unlinked file, it goes nowhere
                        raise _Gone
                except BaseException:
                    _rollback(conn)
                    raise
                self._commit(conn, mark, what)
            self._synced(f, start, data, size)
        except _Gone:
            return
        except (psycopg.Error, PoolTimeout) as exc:
            raise _io_error(exc, what) from exc

    # ------------------------------------------------------------------ commits whose answer is lost

    @staticmethod
    def _marked(cur: Any) -> tuple[int, int]:
        row = cur.fetchone()
        if row is None:  # its row went with a cleanup (its session looked dead): refuse, nothing is written
            raise OSError(errno.EIO, "PostgreSQL store: this connection is not registered in onceflow_commits")
        return int(row[0]), int(row[1])

    def _commit(self, conn: Any, mark: tuple[int, int] | None, what: str) -> None:
        """COMMIT; if its answer is lost, a write learns what became of it (:meth:`_settle`) while the
        failed connection is still held (so the pool lends it to nobody meanwhile)."""
        try:
            conn.commit()
        except psycopg.Error as exc:
            if mark is None:
                raise
            self._settle(mark, what, exc)

    def _settle(self, mark: tuple[int, int], what: str, exc: Exception) -> None:
        """The COMMIT of a writing transaction failed (``exc``): return if the transaction committed
        after all, raise an ``OSError`` if it surely did not, and :class:`OutcomeUnknown` if that
        could not be learned while :attr:`alive` said to go on.

        The transaction counted itself on its connection's row (``mark``: the row and the count
        it wrote). The row is read back ``FOR UPDATE`` on a connection of its own: that waits until
        the transaction is over (it holds the row's lock until its commit or rollback is done), so
        what is read is final: the count is there if and only if it committed. And reading it so
        is itself a write (a row lock), whose commit waits for a synchronous standby to hold the
        WAL up to it, the lost commit's included: "committed" is answered only once the commit is
        as durable as any other. After a failover the new primary holds the count if and only if
        the commit reached it."""
        conn_id, seq = mark
        until = None if self.alive is not None else self._clock() + self.connect_timeout
        pause = 0.05
        why: Exception = exc
        while True:
            try:
                with self._connect() as check:
                    check.execute(f"SET lock_timeout = {max(100, int(self.connect_timeout * 250))}")
                    row = check.execute(
                        "SELECT seq FROM onceflow_commits WHERE conn = %s FOR UPDATE", (conn_id,)
                    ).fetchone()
                    check.commit()
            except psycopg.Error as again:
                why = again
            else:
                if row is None:  # a new leader removed the row of this server's connection: deposed
                    why = OSError(errno.EIO, "its record was removed by another server's cleanup")
                    break
                if int(row[0]) >= seq:
                    log.warning("PostgreSQL store: %s: the answer to COMMIT was lost; it committed", what)
                    return
                log.warning("PostgreSQL store: %s: the answer to COMMIT was lost; it did not commit", what)
                raise _io_error(exc, what) from exc
            if (self.alive is not None and not self.alive()) or (until is not None and self._clock() >= until):
                break
            self._sleep(pause)
            pause = min(0.5, pause * 2)
        reason = f"the outcome of the {what} is unknown: the answer to its COMMIT was lost ({exc}) and could not be read back ({why})"
        raise self._unknown(reason) from exc

    def _unknown(self, reason: str) -> OutcomeUnknown:
        """A write's outcome stays unknown (``reason``): no more writes, and the holder is told once."""
        log.error("PostgreSQL store: %s; this server writes nothing more", reason)
        first = self.unsure is None
        self.unsure = reason
        if first and self.on_unsure is not None:
            self.on_unsure(reason)
        return OutcomeUnknown(f"PostgreSQL store: {reason}")

    def _off_loop(self, call: Callable[[], Any], what: str, *, write: bool) -> Any:
        """``call`` (a call into the database made on an event loop's thread: :func:`_loop_bound`),
        waited for at most :attr:`write_timeout` (``write``) or :attr:`read_timeout`. A read that
        overran is :class:`ReadTimedOut` (nothing changed: retry). A write that overran may still
        commit: its outcome is unknown, so the store refuses every later write and tells its holder
        (:meth:`_unknown`: a leader steps down, and the next one's recovery reads what committed)."""
        seconds = self.write_timeout if write else self.read_timeout
        try:
            return self._connector.bounded(call, seconds)
        except Overran:
            if not write:
                raise ReadTimedOut(what, seconds) from None
            raise self._unknown(
                f"the outcome of the {what} is unknown: the database did not finish it within the store's "
                f"write_timeout ({seconds:g} s), and it may still commit"
            ) from None

    def _refuse_if_unsure(self, what: str) -> None:
        if self.unsure is not None:
            raise OSError(
                errno.EIO, f"PostgreSQL store: {what} refused: an earlier write's outcome is unknown ({self.unsure})"
            )

    def _lease_check(self, conn: Any) -> Any:
        if self.token is None:
            return None
        return conn.execute("SELECT token FROM onceflow_lease WHERE id = 1 FOR KEY SHARE")

    def _lease_verify(self, cur: Any) -> None:
        if cur is None or self.token is None:
            return
        row = cur.fetchone()
        now = None if row is None else int(row[0])
        if now != self.token:
            raise LeaseLost(self.token, now)

    @_loop_bound("read")
    def read_range(self, ident: int, at: int, n: int) -> bytes:
        """Bytes [at, at + n) of file ``ident`` as the database holds them (short at its end).

        A client's cold read (older than the memory cache) comes here in a thread of
        :meth:`read_cold`; other reads of the loop (the sweep's headers, a fork's check of its
        offset) from the loop's thread. Either way its one query is bounded by :attr:`read_timeout`
        (:meth:`_tx`), and its size by the caller (a client's read: at most the server's
        ``max_read_bytes``, 4 MiB by default, or one batch larger than that; the sweep: one batch
        header)."""
        pre = self._pre
        if pre is not None:
            whole = pre.data.get(ident)
            if whole is not None:
                return whole[at : at + n]
        end = at + n
        with self._tx(f"read of bytes {at} to {end} of file {ident}", fence=False, read=True) as cur:
            # only the part of each chunk in the range, in binary (bytea as text is twice the bytes)
            cur.execute(
                "SELECT greatest(at, %(lo)s) AS pos, substring(data FROM (greatest(at, %(lo)s) - at + 1)::int "
                "FOR (least(at + length(data), %(hi)s) - greatest(at, %(lo)s))::int) "
                "FROM onceflow_chunks WHERE file = %(f)s AND at < %(hi)s AND at + length(data) > %(lo)s AND at >= "
                "coalesce((SELECT max(at) FROM onceflow_chunks WHERE file = %(f)s AND at <= %(lo)s), 0) ORDER BY at",
                {"f": ident, "lo": at, "hi": end},
                binary=True,
            )
            rows = cur.fetchall()
        out = bytearray()
        for pos, data in rows:
            if pos > at + len(out):
                out += bytes(pos - at - len(out))  # a hole
            out += data
        return bytes(out)

    async def read_cold(self, f: PgFile, at: int, n: int) -> bytes:
        """Bytes [at, at + n) of ``f`` from the database (zeros past what it holds, as
        :meth:`PgFile.pread`), for a coroutine on the event loop, which serves others meanwhile: a
        client's catch-up read of bytes older than the memory cache (:meth:`PgFile.apread`).

        1. Wait for one of :attr:`cold_reads` turns, at most :attr:`read_timeout` seconds (past
           it :class:`ReadTimedOut`: the database is too slow for the reads asked of it; retry).
        2. Read in a thread of :data:`_THREADS`, which bounds its waits as for a call made on the
           loop (the pool's wait and the statement: :attr:`read_timeout` each). It touches the
           file's id and the pool, nothing the loop changes. The turn is taken until the thread
           is done, whoever still waits for it: never more than :attr:`cold_reads` reads in the
           database at once, nor connections of the pool.
        3. Wait for it at most :attr:`read_timeout` seconds (a frozen database answers nothing, so
           no statement_timeout fires): past it :class:`ReadTimedOut`, and the thread goes on
           alone. A caller cancelled meanwhile (its client went away) leaves it too.

        The bytes are those the database holds when the thread reads them: the caller checks that
        the file still has them (removed files read as zeros)."""
        loop = asyncio.get_running_loop()
        turns = self._turns.get(loop)
        if turns is None:
            turns = self._turns[loop] = asyncio.Semaphore(self.cold_reads)
        what = f"read of bytes {at} to {at + n} of file {f.id}"
        # Step 1
        self.cold_waiting += 1
        try:
            async with asyncio.timeout(self.read_timeout) as waited:
                await turns.acquire()
        except TimeoutError:
            if not waited.expired():
                raise
            raise ReadTimedOut(f"{what}, waiting for a turn of {self.cold_reads},", self.read_timeout) from None
        finally:
            self.cold_waiting -= 1
        # Step 2
        self.cold_running += 1
        try:
            fut = loop.run_in_executor(_BOUNDED_CALLS, f._from_database, at, n)
        except BaseException:
            self.cold_running -= 1
            turns.release()
            raise
        fut.add_done_callback(functools.partial(self._cold_done, turns))
        # Step 3
        try:
            async with asyncio.timeout(self.read_timeout) as waited:
                return await asyncio.shield(fut)
        except TimeoutError:
            if not waited.expired():
                raise
            raise ReadTimedOut(what, self.read_timeout) from None

    def _cold_done(self, turns: asyncio.Semaphore, fut: asyncio.Future[bytes]) -> None:
        """A cold read's thread is done (on the loop): its turn is free."""
        self.cold_running -= 1
        turns.release()
        if not fut.cancelled():
            fut.exception()  # retrieved: nobody may await it any more (its caller gave up)

    # ------------------------------------------------------------------ a tree read at once

    @contextmanager
    def preloaded(self, root: Path, *, small: int = 64 << 10) -> Iterator[None]:
        """While the block runs, answer reads under ``root`` (listings, existence, opening files,
        whole small files and their ranges) from one reading of the tree: two queries in all,
        instead of a dozen round trips a stream for recovery. What this process writes meanwhile
        keeps it true (a sync updates it; any other change of the tree but a whole-file replace
        drops it, and reads go to the database again); no other server writes while this one holds
        the lease. Files larger than ``small`` bytes are listed, their bytes read as before.

        Whole-file replacements under ``root`` (recovery's snapshots, one a stream after a crash)
        are *deferred*: they read back at once here, and are written in one transaction when the
        block ends, before it returns (an error there is raised from the block). So they are
        durable when the block returns, not when each returns: only for a caller that, as
        recovery, acts on none of them before the block ends."""
        key = str(root)
        below = key.rstrip("/") + "/"
        with self._tx(f"read the tree {key}", fence=False) as cur:
            cur.execute(
                "SELECT path, parent, id, size FROM onceflow_files WHERE path = %s OR starts_with(path, %s)",
                (key, below),
            )
            rows = [(str(p), str(q), None if i is None else int(i), int(n)) for p, q, i, n in cur.fetchall()]
            cur.execute(
                "SELECT c.file, c.at, c.data FROM onceflow_chunks c JOIN onceflow_files f ON f.id = c.file "
                "WHERE starts_with(f.path, %s) AND f.size <= %s ORDER BY c.file, c.at",
                (below, small),
                binary=True,
            )
            parts: dict[int, bytearray] = {}
            for ident, at, chunk in cur.fetchall():
                buf = parts.setdefault(int(ident), bytearray())
                if at > len(buf):
                    buf += bytes(at - len(buf))  # a hole
                buf[at : at + len(chunk)] = chunk
        sizes = {i: n for _, _, i, n in rows if i is not None}
        data = {i: bytes(buf[: sizes[i]]).ljust(sizes[i], b"\0") for i, buf in parts.items() if i in sizes}
        for ident, size in sizes.items():
            if size == 0:
                data[ident] = b""
        pre = _Preload(key, rows, data)
        with self._pre_lock:
            self._pre = pre
        try:
            yield
            self._write_deferred()
        finally:
            with self._pre_lock:
                self._pre = None
        if pre.failed is not None:  # a caller swallowed it (rmtree is best effort): the replacements are lost
            raise OSError(errno.EIO, f"PostgreSQL store: the deferred replacements under {key} failed: {pre.failed}")

    def _write_deferred(self) -> None:
        """The whole-file replacements made while the tree was read at once, in one transaction."""
        with self._pre_lock:
            pre = self._pre
            if pre is None or not pre.deferred:
                return
            todo, pre.deferred = pre.deferred, {}
        paths = list(todo)
        try:
            ids = self._replace_all(pre.root, todo)
        except BaseException as exc:
            pre.failed = exc
            raise
        with self._pre_lock:
            for p in paths:
                was = pre.files.get(p)
                if was is not None and was[0] is not None:
                    pre.data.pop(was[0], None)
                pre.files[p] = (ids[p], len(todo[p]))
                pre.data[ids[p]] = todo[p]

    def _replace_all(self, root: str, todo: dict[str, bytes]) -> dict[str, int]:
        """Replace the files ``todo`` names, with their bytes, in one transaction; their new ids."""
        paths = list(todo)
        with self._tx(f"replace {len(paths)} files under {root}") as cur:
            cur.execute(
                "DELETE FROM onceflow_chunks WHERE file IN (SELECT id FROM onceflow_files WHERE path = ANY(%s))",
                (paths,),
            )
            cur.execute("DELETE FROM onceflow_files WHERE path = ANY(%s)", (paths,))
            cur.execute(
                "INSERT INTO onceflow_files (path, parent, id, size) "
                "SELECT p, q, nextval('onceflow_file_ids'), n FROM unnest(%s::text[], %s::text[], %s::bigint[]) "
                "AS t(p, q, n) RETURNING path, id",
                (paths, [_parent(p) for p in paths], [len(todo[p]) for p in paths]),
            )
            ids = {str(p): int(i) for p, i in cur.fetchall()}
            cur.executemany(
                "INSERT INTO onceflow_chunks (file, at, data) VALUES (%s, 0, %s)",
                [(ids[p], todo[p]) for p in paths if todo[p]],
            )
        return ids

    def _synced(self, f: PgFile, start: int, data: bytes, size: int) -> None:
        """A sync of ``f`` committed: the tree read at once holds its new size and bytes."""
        if self._pre is None:
            return
        key = str(f.path)
        with self._pre_lock:
            pre = self._preload_for(key)
            if pre is None or pre.files.get(key, (None, 0))[0] != f.id:  # not (or no longer) that path's file
                return
            pre.files[key] = (f.id, size)
            old = pre.data.get(f.id)
            if old is not None:
                pre.data[f.id] = (old[:start].ljust(start, b"\0") + data)[:size].ljust(size, b"\0")

    def _preload_for(self, key: str) -> _Preload | None:
        pre = self._pre
        return pre if pre is not None and pre.covers(key) else None

    def _tree_changed(self, key: str) -> None:
        """This process changes the tree at ``key``: what was read at once no longer says so (the
        deferred replacements are written first, in their order before this change)."""
        if self._preload_for(key) is None:
            return
        try:
            self._write_deferred()
        finally:
            with self._pre_lock:
                if self._pre is not None and self._pre.covers(key):
                    self._pre = None

    # ------------------------------------------------------------------ the FileSystem protocol

    @_loop_bound("open")
    def open_file(self, path: Path, *, create: bool) -> File:
        key = str(path)
        pre = self._preload_for(key)
        if pre is not None and key in pre.deferred:
            self._write_deferred()
        if pre is not None and not create:
            ident, size = pre.file(key)
            return PgFile(self, path, ident, size)
        if create:
            self._tree_changed(key)
        with self._tx(f"open {key}", fence=create, read=not create) as cur:
            cur.execute("SELECT id, size FROM onceflow_files WHERE path = %s", (key,))
            row = cur.fetchone()
            if row is not None and row[0] is None:
                raise IsADirectoryError(errno.EISDIR, "is a directory", key)
            if row is None:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, "no such file", key)
                self._need_dir(cur, _parent(key))
                cur.execute(
                    "INSERT INTO onceflow_files (path, parent, id, size) "
                    "VALUES (%s, %s, nextval('onceflow_file_ids'), 0) RETURNING id, size",
                    (key, _parent(key)),
                )
                row = cur.fetchone()
        assert row is not None
        return PgFile(self, path, int(row[0]), int(row[1]))

    @_loop_bound("read")
    def listdir(self, path: Path) -> list[str]:
        key = str(path)
        pre = self._preload_for(key)
        if pre is not None:
            found = pre.files.get(key)
            if found is None:
                raise FileNotFoundError(errno.ENOENT, "no such directory", key)
            if found[0] is not None:
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", key)
            return list(pre.children.get(key, []))
        with self._tx(f"list {key}", fence=False, read=True) as cur:
            cur.execute("SELECT path, id FROM onceflow_files WHERE path = %s", (key,))
            row = cur.fetchone()
            if row is None:
                raise FileNotFoundError(errno.ENOENT, "no such directory", key)
            if row[1] is not None:
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", key)
            cur.execute("SELECT path FROM onceflow_files WHERE parent = %s AND path <> parent", (key,))
            return [Path(p).name for (p,) in cur.fetchall()]

    @_loop_bound("write")
    def mkdir(self, path: Path) -> None:
        key = str(path)
        pre = self._preload_for(key)
        if pre is None or pre.files.get(key, (0, 0))[0] is not None:  # not a directory known to be there
            self._tree_changed(key)
        with self._tx(f"mkdir {key}") as cur:
            chain = [key, *(str(p) for p in path.parents)]
            cur.execute("SELECT path, id FROM onceflow_files WHERE path = ANY(%s)", (chain,))
            for p, ident in cur.fetchall():
                if ident is not None:
                    raise FileExistsError(errno.EEXIST, "a file is in the way", p)
            cur.executemany(
                "INSERT INTO onceflow_files (path, parent, id) VALUES (%s, %s, NULL) ON CONFLICT (path) DO NOTHING",
                [(p, _parent(p)) for p in chain],
            )

    @_loop_bound("read")
    def exists(self, path: Path) -> bool:
        pre = self._preload_for(str(path))
        if pre is not None:
            return str(path) in pre.files or str(path) in pre.deferred
        with self._tx("exists", fence=False, read=True) as cur:
            cur.execute("SELECT 1 FROM onceflow_files WHERE path = %s", (str(path),))
            return cur.fetchone() is not None

    @_loop_bound("write")
    def unlink(self, path: Path) -> None:
        key = str(path)
        self._tree_changed(key)
        with self._tx(f"unlink {key}") as cur:
            cur.execute("DELETE FROM onceflow_files WHERE path = %s AND id IS NOT NULL RETURNING id", (key,))
            row = cur.fetchone()
            if row is not None:
                cur.execute("DELETE FROM onceflow_chunks WHERE file = %s", (row[0],))

    @_loop_bound("write")
    def rename(self, src: Path, dst: Path) -> None:
        s, d = str(src), str(dst)
        if s == d:
            return
        self._tree_changed(s)
        self._tree_changed(d)
        with self._tx(f"rename {s} to {d}") as cur:
            cur.execute("SELECT id FROM onceflow_files WHERE path = %s", (s,))
            row = cur.fetchone()
            if row is None:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", s)
            self._need_dir(cur, _parent(d))
            is_dir = row[0] is None
            cur.execute("SELECT id FROM onceflow_files WHERE path = %s", (d,))
            there = cur.fetchone()
            if there is not None:
                if is_dir != (there[0] is None):
                    raise (IsADirectoryError if there[0] is None else NotADirectoryError)(errno.EISDIR, "type", d)
                if is_dir:
                    cur.execute("SELECT 1 FROM onceflow_files WHERE parent = %s AND path <> parent LIMIT 1", (d,))
                    if cur.fetchone() is not None:
                        raise OSError(errno.ENOTEMPTY, "directory not empty", d)
                else:
                    cur.execute("DELETE FROM onceflow_chunks WHERE file = %s", (there[0],))
                cur.execute("DELETE FROM onceflow_files WHERE path = %s", (d,))
            cur.execute("UPDATE onceflow_files SET path = %s, parent = %s WHERE path = %s", (d, _parent(d), s))
            if is_dir:  # everything below moves with it
                n = len(s)
                cur.execute(
                    "UPDATE onceflow_files SET path = %s || substr(path, %s), "
                    "parent = %s || substr(parent, %s) WHERE starts_with(path, %s)",
                    (d, n + 1, d, n + 1, s + "/"),
                )

    def rmtree(self, path: Path) -> None:
        try:
            self._rmtree(str(path))
        except OSError as exc:  # best effort, as the protocol says
            log.warning("could not remove %s: %s", path, exc)

    @_loop_bound("write")
    def _rmtree(self, key: str) -> None:
        self._tree_changed(key)
        with self._tx(f"rmtree {key}") as cur:
            cur.execute(
                "DELETE FROM onceflow_files WHERE path = %s OR starts_with(path, %s) RETURNING id",
                (key, key.rstrip("/") + "/"),
            )
            ids = [i for (i,) in cur.fetchall() if i is not None]
            if ids:
                cur.execute("DELETE FROM onceflow_chunks WHERE file = ANY(%s)", (ids,))

    def sync_dir(self, path: Path) -> None:
        """Nothing to do: a directory operation is durable when it returns."""

    @_loop_bound("read")
    def read_bytes(self, path: Path) -> bytes:
        key = str(path)
        pre = self._preload_for(key)
        if pre is not None:
            if key in pre.deferred:
                return pre.deferred[key]
            ident, _ = pre.file(key)
            if ident in pre.data:
                return pre.data[ident]
        with self._tx(f"read {key}", fence=False, read=True) as cur:
            cur.execute("SELECT id, size FROM onceflow_files WHERE path = %s", (key,))
            row = cur.fetchone()
        if row is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        if row[0] is None:
            raise IsADirectoryError(errno.EISDIR, "is a directory", key)
        data = self.read_range(int(row[0]), 0, int(row[1]))
        return data + bytes(int(row[1]) - len(data))

    @_loop_bound("write")
    def replace_file(
        self, path: Path, data: bytes, *, sync: bool = True, sync_dir: bool = True, mode: int = 0o666
    ) -> None:
        """Replace the whole file at once (durable when it returns, whatever ``sync`` says;
        ``mode`` has no meaning here: the database's own access control protects the data)."""
        key = str(path)
        with self._pre_lock:
            pre = self._preload_for(key)
            if pre is not None:
                parent, here = pre.files.get(_parent(key)), pre.files.get(key)
                if parent is not None and parent[0] is None and (here is None or here[0] is not None):
                    if here is None and key not in pre.deferred:
                        pre.children.setdefault(_parent(key), []).append(path.name)
                    pre.deferred[key] = bytes(data)  # in a known directory, over a file or nothing
                    return
        with self._tx(f"replace {key}") as cur:
            self._need_dir(cur, _parent(key))
            cur.execute("SELECT id FROM onceflow_files WHERE path = %s", (key,))
            row = cur.fetchone()
            if row is not None:
                if row[0] is None:
                    raise IsADirectoryError(errno.EISDIR, "is a directory", key)
                cur.execute("DELETE FROM onceflow_chunks WHERE file = %s", (row[0],))
                cur.execute("DELETE FROM onceflow_files WHERE path = %s", (key,))
            cur.execute(
                "INSERT INTO onceflow_files (path, parent, id, size) "
                "VALUES (%s, %s, nextval('onceflow_file_ids'), %s) RETURNING id",
                (key, _parent(key), len(data)),
            )
            ident = cur.fetchone()[0]
            if data:
                cur.execute("INSERT INTO onceflow_chunks (file, at, data) VALUES (%s, 0, %s)", (ident, data))
        with self._pre_lock:
            pre = self._preload_for(key)
            if pre is not None:
                was = pre.files.get(key)
                if was is None:
                    pre.children.setdefault(_parent(key), []).append(path.name)
                elif was[0] is not None:
                    pre.data.pop(was[0], None)
                pre.files[key] = (int(ident), len(data))
                pre.data[int(ident)] = bytes(data)

    @staticmethod
    def _need_dir(cur: Any, key: str) -> None:
        cur.execute("SELECT id FROM onceflow_files WHERE path = %s", (key,))
        row = cur.fetchone()
        if row is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", key)
        if row[0] is not None:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", key)
