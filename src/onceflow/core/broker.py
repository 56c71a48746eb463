"""Streams, idempotent producers, forks and expiry over the storage layer.

The broker knows the protocol's semantics but not HTTP: every operation returns an
:class:`Outcome` whose ``kind`` names what happened (an :data:`OutcomeKind`) or why it was refused
(a :class:`~onceflow.core.refusal.Refusal`), and ``onceflow.server.answers`` maps refusals to status
codes in one table.

Concurrency: everything runs on one event loop. An append validates and stages its batch without
awaiting in between, so validation + append is serialised per stream (and therefore per
``(stream, producer)``, as the protocol requires). It then awaits durability.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from ..storage.batch import FLAG_CLOSE, FLAG_COMMIT, FLAG_CONTROL, FLAG_JSON, FLAG_TXN, CorruptBatch
from ..storage.fs import FileSystem, OsFileSystem, OutcomeUnknown
from ..storage.log import (
    FsyncPolicy,
    InvalidPosition,
    IoEvents,
    LogClosed,
    OffsetGone,
    ReadBatch,
    Staged,
    StreamLog,
)
from ..storage.meta import META_NAME, StreamMeta, read_meta, write_meta
from ..storage.position import Position, parse_token
from ..wire import MAX_SAFE_INT
from .clock import SYSTEM, Clock
from .coordinator import Coordinator
from .jsonmode import JsonError, encode_messages, first_messages
from .refusal import Refusal
from .txn import TXN_PRODUCER_PREFIX, CommitSeen, OpenTxn, StateLimits, TxnError, TxnMeta, TxnStatus

__all__ = [
    "MAX_NAME_BYTES",
    "Broker",
    "Outcome",
    "ProducerHeaders",
    "ReadResult",
    "StreamState",
    "normalize_content_type",
    "validate_name",
]

log = logging.getLogger("onceflow.broker")

MAX_NAME_BYTES = 1024
_CONTENT_TYPE = re.compile(r"^[\w.+-]+/[\w.+-]+")
_TTL = re.compile(r"^(0|[1-9][0-9]*)$")
ZERO = Position(0, 0)
REORDER_WINDOW = 64  # how far ahead of the producer's next sequence a request may wait
# The sweep (expiry and retention over every stream) holds the event loop for at most this many
# seconds of work at a time, plus one stream's step, then lets every other task run: a sweep over
# thousands of streams (a header read each, on the PostgreSQL store a database round trip) never
# stalls the clients for its whole length.
SWEEP_SLICE = 0.02


class _Slices:
    """Cuts a long pass over the streams into slices of :data:`SWEEP_SLICE` seconds of the loop.
    Measured on the machine's clock (``time.perf_counter``), not the broker's: what it bounds is
    how long other tasks wait, which simulated time does not see."""

    __slots__ = ("_began",)

    def __init__(self) -> None:
        self._began = time.perf_counter()

    async def pause(self) -> None:
        """Let other tasks run if this slice used up its time (call between two streams' steps)."""
        if time.perf_counter() - self._began >= SWEEP_SLICE:
            await asyncio.sleep(0)
            self._began = time.perf_counter()


def normalize_content_type(ct: str | None) -> str:
    """The media type alone, lower-cased: ``Application/JSON; charset=utf-8`` → ``application/json``."""
    if not ct:
        return ""
    return ct.split(";", 1)[0].strip().lower()


def validate_name(name: str) -> str | None:
    """None when ``name`` is an acceptable stream name, else what is wrong with it.

    Names are paths of ``/``-separated segments. They never reach the file system (a stream's
    directory is named by a hash of its name), but names that look like escapes are refused anyway
    so that no client can be confused about what they address.
    """
    if not name:
        return "stream name is empty"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"stream name is longer than {MAX_NAME_BYTES} bytes"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "stream name contains a NUL or control character"
    if name.startswith("/") or name.endswith("/"):
        return "stream name must not start or end with '/'"
    for seg in name.split("/"):
        if seg in ("", ".", ".."):
            return "stream name has an empty, '.' or '..' segment"
    if "\\" in name:
        return "stream name must not contain a backslash"
    return None


@dataclass(frozen=True, slots=True)
class ProducerHeaders:
    producer_id: str
    epoch: int
    seq: int


OutcomeKind = Literal["created", "exists", "appended", "duplicate", "closed_now", "already_closed", "deleted"]
"""What an operation did when it did it; a refusal is a :class:`~onceflow.core.refusal.Refusal`."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an operation did, in the broker's words. ``detail`` is a sentence for the client."""

    kind: OutcomeKind | Refusal
    stream: StreamState | None = None
    next: Position | None = None
    closed: bool = False
    epoch: int | None = None
    seq: int | None = None
    expected_seq: int | None = None
    received_seq: int | None = None
    txn: int | None = None  # the transaction number a transactional append joined
    committed: bool = False  # the append also committed its transaction (Transaction-Commit)
    detail: str = ""


@dataclass(slots=True)
class ReadResult:
    batches: list[ReadBatch]
    next: Position
    up_to_date: bool
    closed: bool  # closed and the reader has reached the final offset


@dataclass(eq=False)
class StreamState:
    """One live stream as the broker holds it: its metadata, its own log and, for a fork, its
    parent and its forks (the client's handle on a stream is :class:`onceflow.client.Stream`)."""

    meta: StreamMeta
    directory: Path
    log: StreamLog
    parent: StreamState | None = None
    clock: Clock = SYSTEM
    # live forks of this stream (soft-deleted ones too); a dict used as an ordered set, like the
    # waiters: woken in a fixed order (and deterministically, which the simulator's replays rely on)
    children: dict[StreamState, None] = field(default_factory=dict)
    last_access: float = 0.0
    waiters: dict[asyncio.Future[None], None] = field(default_factory=dict)
    staged_waiters: dict[asyncio.Future[None], None] = field(default_factory=dict)  # out-of-order producer requests
    deleted: bool = False

    @property
    def name(self) -> str:
        return self.meta.name

    def __post_init__(self) -> None:
        self.last_access = self.clock.monotonic()
        self.media_type = normalize_content_type(self.meta.content_type)
        self.is_json = self.media_type == "application/json"
        self._told: tuple[Position | None] | None = None  # the first_open() the forks were last told about

    @property
    def forks(self) -> int:
        return len(self.children)

    @property
    def tail(self) -> Position:
        """The durable tail as clients see it. Once the stream is closed, the end of its data: a
        close marker (and any transaction marker after it) takes no offset space (PROTOCOL.md 5.3)."""
        return self.log.durable.client_end

    def past_final(self, at: Position) -> bool:
        """``at`` is a batch boundary past the tail of this closed stream: an offset after its close
        marker, which clients were given before closing stopped moving the tail. It means the tail."""
        end = self.log.durable.end
        if not self.closed or not self.tail.pos < at.pos <= end.pos or not self.tail.offset <= at.offset <= end.offset:
            return False
        try:
            self.log.check_position(at)
        except InvalidPosition:
            return False
        return True

    @property
    def closed(self) -> bool:
        return self.log.durable.closed

    @property
    def earliest(self) -> Position:
        """The first position a read may start at: where this stream begins, or where retention left
        it. A fork whose own log kept all of its data begins where its source's kept data does."""
        first = self.log.first
        if self.parent is not None and first == self.log.base:
            return self.parent.earliest
        return first

    def touch(self) -> None:
        self.last_access = self.clock.monotonic()

    def expired(self) -> bool:
        if self.meta.expires_at_epoch is not None and self.clock.time() >= self.meta.expires_at_epoch:
            return True
        ttl = self.meta.ttl_seconds
        return ttl is not None and self.clock.monotonic() >= self.last_access + ttl

    def notify_staged(self) -> None:
        for fut in self.staged_waiters:
            if not fut.done():
                fut.set_result(None)

    def notify(self) -> None:
        """Wake the live readers; and, when this stream's LSO moved, those of the forks whose LSO
        it held (their read_committed view of this stream's range just changed): the forks' log
        listeners are told, so their own readers, forks and subscriptions learn of it."""
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)
        self.waiters.clear()
        if self.children:
            # a fork's LSO depends on this stream's open transactions only on those that began
            # before its fork point (later ones begin at or past it); before the first notify
            # (None) that is not known, so every fork is told
            now = self.first_open()
            if self._told is None or self._told[0] != now:
                before, self._told = self._told, (now,)
                for child in list(self.children):
                    if before is None or (before[0] is not None and before[0].pos < child.log.base.pos):
                        child.log.tell_listeners()

    # -- transactions

    def stable(self) -> Position:
        """The last stable offset: read_committed readers see nothing at or past it."""
        first = self.first_open()
        return first if first is not None and first.pos < self.tail.pos else self.tail

    def first_open(self) -> Position | None:
        """Where the earliest transaction still open in what this stream shows began, if any.

        For a fork that includes its parent's transactions that began before the fork point: the
        parent's range is read through them, exactly as the parent's readers see it."""
        if self.parent is not None:
            above = self.parent.first_open()
            if above is not None and above.pos < self.log.base.pos:
                return above
        return self.log.txn.stable(self.tail) if self.log.txn.open else None

    def is_open_txn(self, batch: ReadBatch) -> bool:
        """``batch`` belongs to a transaction that has not ended yet."""
        if not batch.header.flags & FLAG_TXN or batch.header.flags & FLAG_CONTROL:
            return False
        if batch.start.pos < self.log.base.pos and self.parent is not None:
            return self.parent.is_open_txn(batch)
        began = self.log.txn.open.get(batch.header.producer_id or "")
        return began is not None and began.pos <= batch.start.pos

    def is_aborted(self, batch: ReadBatch) -> bool:
        if not batch.header.flags & FLAG_TXN:
            return False
        if batch.start.pos < self.log.base.pos and self.parent is not None:
            return self.parent.is_aborted(batch)
        return self.log.txn.is_aborted(batch.header.producer_id, batch.start.pos)

    # -- reads across the fork chain

    def check_position(self, at: Position) -> None:
        if at.pos < self.log.base.pos:
            if self.parent is None:
                raise InvalidPosition(f"offset {at.token()} is outside this stream")
            if at.offset > self.log.base.offset:
                raise InvalidPosition(f"offset {at.token()} is not a record boundary of this stream")
            self.parent.check_position(at)
        else:
            self.log.check_position(at)

    async def acheck_position(self, at: Position) -> None:
        """:meth:`check_position` with the logs' reads awaited (``StreamLog.acheck_position``)."""
        if at.pos < self.log.base.pos:
            if self.parent is None:
                raise InvalidPosition(f"offset {at.token()} is outside this stream")
            if at.offset > self.log.base.offset:
                raise InvalidPosition(f"offset {at.token()} is not a record boundary of this stream")
            await self.parent.acheck_position(at)
        else:
            await self.log.acheck_position(at)

    def read_range(self, at: Position, max_bytes: int, limit: Position | None = None) -> list[ReadBatch]:
        if at.pos < self.log.base.pos and self.parent is not None:
            cap = self._parent_cap(limit)
            batches = self.parent.read_range(at, max_bytes, cap)
            if self._on_into_own_log(batches, max_bytes, limit):
                batches += self.log.read(self.log.base, max_bytes - _span(batches), limit)
            return batches
        return self.log.read(at, max_bytes, limit)

    async def aread_range(self, at: Position, max_bytes: int, limit: Position | None = None) -> list[ReadBatch]:
        """:meth:`read_range`, the same batches, with the logs' reads awaited (``StreamLog.aread``:
        other tasks run while a read waits for the PostgreSQL store's database)."""
        if at.pos < self.log.base.pos and self.parent is not None:
            batches = await self.parent.aread_range(at, max_bytes, self._parent_cap(limit))
            if self._on_into_own_log(batches, max_bytes, limit):
                batches += await self.log.aread(self.log.base, max_bytes - _span(batches), limit)
            return batches
        return await self.log.aread(at, max_bytes, limit)

    def _parent_cap(self, limit: Position | None) -> Position:
        """Where a read of this fork's source's range ends: the fork point, or ``limit`` before it."""
        return self.log.base if limit is None or limit.pos > self.log.base.pos else limit

    def _on_into_own_log(self, batches: list[ReadBatch], max_bytes: int, limit: Position | None) -> bool:
        """Whether a read that got ``batches`` of the source's range goes on into this fork's own log."""
        return (
            bool(batches)
            and batches[-1].end.pos >= self.log.base.pos
            and _span(batches) < max_bytes
            and (limit is None or limit.pos > self.log.base.pos)
        )


def _span(batches: list[ReadBatch]) -> int:
    return sum(b.end.pos - b.start.pos for b in batches)


@dataclass(frozen=True, slots=True)
class Retention:
    """A stream's own retention, as its create asked (None: the server's default)."""

    seconds: int | None = None
    bytes: int | None = None
    keep_groups: tuple[str, ...] | None = None

    @classmethod
    def of(cls, meta: StreamMeta) -> Retention:
        groups = meta.retention_keep_groups
        return cls(meta.retention_seconds, meta.retention_bytes, tuple(groups) if groups is not None else None)


_MAX_KEEP_GROUPS = 16


def parse_retention(seconds: str | None, size: str | None, keep_groups: str | None) -> Retention | str:
    """The ``Stream-Retention-*`` headers of a create, or what is wrong with them."""
    out: list[int | None] = []
    for header, raw in (("Stream-Retention-Seconds", seconds), ("Stream-Retention-Bytes", size)):
        if raw is None:
            out.append(None)
        elif not _TTL.match(raw) or not 1 <= int(raw) <= MAX_SAFE_INT:
            return f"{header} must be a positive integer, got {raw!r}"
        else:
            out.append(int(raw))
    groups: tuple[str, ...] | None = None
    if keep_groups is not None:
        groups = tuple(g.strip() for g in keep_groups.split(","))
        if not 1 <= len(groups) <= _MAX_KEEP_GROUPS or any(not g or validate_name(g) for g in groups):
            return (
                f"Stream-Retention-Keep-Groups must list 1 to {_MAX_KEEP_GROUPS} group names separated by commas, "
                f"got {keep_groups!r}"
            )
    return Retention(out[0], out[1], groups)


@dataclass(slots=True)
class _CreateSpec:
    """A create request's parsed headers; a fork fills in what it inherits from its source."""

    name: str
    content_type: str | None
    ttl_seconds: int | None
    expires_at: str | None
    expires_epoch: float | None
    closed: bool
    fork_from: str | None
    fork_pos: Position | None
    sub_offset: int
    retention: Retention


@dataclass(slots=True)
class _Fork:
    """Where a new stream starts: its source (None for a plain create), base and sub-offset prefix."""

    parent: StreamState | None
    base: Position
    prefix: tuple[bytes, int] | None
    inherited: bool = False


def unstored(what: str, exc: OSError, stream: StreamState | None = None, refused: str | None = None) -> Outcome:
    """The answer to a write the store did not make durable: refused (``refused``, by default "the
    <what> was not stored"; a retry may succeed), or, when the store could not learn whether it did
    (:class:`OutcomeUnknown`), said to be unknown: never "not stored" for data that may be served later."""
    if isinstance(exc, OutcomeUnknown):
        return Outcome(
            Refusal.OUTCOME_UNKNOWN,
            stream=stream,
            detail=f"the outcome of the {what} is unknown: it may have been stored or not ({exc.strerror or exc}); "
            "retry it with the same producer headers to have it stored once",
        )
    refused = refused or f"the {what} was not stored"
    return Outcome(Refusal.UNAVAILABLE, stream=stream, detail=f"{refused}: {exc.strerror or exc}")


class Broker:
    """All streams under one data directory."""

    def __init__(
        self,
        data_dir: Path | str,
        *,
        fsync: FsyncPolicy = "always",
        segment_bytes: int = 64 << 20,
        max_read_bytes: int = 4 << 20,
        fsync_interval: float = 1.0,
        reorder_wait: float = 0.5,
        txn_timeout: float = 60.0,
        max_streams: int = 100_000,
        retention_seconds: int | None = None,
        retention_bytes: int | None = None,
        retention_interval: float = 10.0,
        fs: FileSystem | None = None,
        clock: Clock = SYSTEM,
        state_limits: StateLimits | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        # the default retention of streams that set none of their own (None: keep everything)
        self.retention_seconds = retention_seconds
        self.retention_bytes = retention_bytes
        self.retention_interval = retention_interval
        # the server's disk: open files bounded (storage/fs.py); the simulator passes its own
        self.fs: FileSystem = fs or OsFileSystem()
        self.clock = clock
        self.max_streams = max_streams
        self.streams_dir = self.data_dir / "streams"
        self.trash_dir = self.data_dir / "trash"
        self.fsync: FsyncPolicy = fsync
        self.segment_bytes = segment_bytes
        self.max_read_bytes = max_read_bytes
        self.fsync_interval = fsync_interval
        self.reorder_wait = reorder_wait
        # every log's writes, syncs and I/O failures, for whoever observes them (the server's /metrics)
        self.io = IoEvents()
        self.coordinator = Coordinator(
            self.data_dir / "coordinator",
            policy=fsync,
            default_timeout=txn_timeout,
            fs=self.fs,
            clock=clock,
            io=self.io,
            limits=state_limits,
        )
        self.coordinator.write_marker = self._write_marker
        self._unfinished: list[TxnMeta] = []
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="onceflow-io")
        self.streams: dict[str, StreamState] = {}
        # told the name of each stream deleted, by a request, the expiry sweep or its last fork
        self.on_delete: list[Callable[[str], None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Recover every stream from disk. Call before serving; blocking."""
        fs = self.fs
        fs.mkdir(self.streams_dir)
        fs.mkdir(self.trash_dir)
        fs.sync_dir(self.data_dir)  # names are durable only once their directory is synced
        fs.sync_dir(self.data_dir.parent)
        for leftover in fs.listdir(self.trash_dir):
            fs.rmtree(self.trash_dir / leftover)
        # a file system that can read the whole tree at once (the PostgreSQL store) does, for the
        # recovery below: a dozen round trips a stream otherwise
        preloaded = getattr(fs, "preloaded", None)
        with preloaded(self.data_dir) if preloaded is not None else contextlib.nullcontext():
            self._recover_all()

    def _recover_all(self) -> None:
        """Every stream's log and the coordinator's, as :meth:`open` found them."""
        fs = self.fs
        metas: list[tuple[StreamMeta, Path]] = []
        for name in sorted(fs.listdir(self.streams_dir)):
            d = self.streams_dir / name
            if not fs.exists(d / META_NAME):
                log.warning("removing %s: its creation never completed", d)
                fs.rmtree(d)
                continue
            try:
                metas.append((read_meta(fs, d), d))
            except (ValueError, TypeError) as exc:  # damaged content: no retry would read it
                log.error("skipping stream directory %s: unreadable metadata: %s", d, exc)
            # an OSError (a failed read, a connection to the PostgreSQL store reset) is raised: a
            # start without the stream would serve 404 for it, acknowledged appends and all, and a
            # create of its name would trash its directory as debris; the next start reads it
        for meta, d in metas:
            self._register(StreamState(meta, d, self._open_log(d, meta.base), clock=self.clock))
        for s in self.streams.values():
            if s.meta.fork_parent is not None:
                s.parent = self.streams.get(s.meta.fork_parent)
                if s.parent is None:
                    log.error("fork %r lost its parent %r", s.name, s.meta.fork_parent)
                else:
                    s.parent.children[s] = None
        self._unfinished = self.coordinator.open()

    async def start(self) -> None:
        """Reconcile the transactions the streams hold open with the coordinator, finish those
        decided before a crash and abort the undecided ones, then start the background tasks."""
        await self.coordinator.recover(self._unfinished, self.open_transactions(), self.commit_markers())
        self._unfinished = []
        self.start_background()

    def open_transactions(self) -> list[OpenTxn]:
        """Every transactional producer with data but no marker yet in a stream (durable state)."""
        found: list[OpenTxn] = []
        for s in self.streams.values():
            for pid in s.log.txn.open:
                if not pid.startswith(TXN_PRODUCER_PREFIX):
                    continue  # only "txn:<tid>" producers may append transactionally
                state = s.log.durable_producer(pid)
                found.append(
                    OpenTxn(
                        s.name,
                        pid[len(TXN_PRODUCER_PREFIX) :],
                        state.epoch if state is not None else -1,
                        s.log.txn.ended.get(pid),
                    )
                )
        return found

    def commit_markers(self) -> list[CommitSeen]:
        """The last commit marker of every transactional producer in every stream (durable state)."""
        return [
            CommitSeen(s.name, pid[len(TXN_PRODUCER_PREFIX) :], epoch, txn)
            for s in self.streams.values()
            for pid, (epoch, txn) in s.log.txn.committed.items()
            if pid.startswith(TXN_PRODUCER_PREFIX)
        ]

    def start_background(self) -> None:
        """Start the expiry sweeper (and the sync timer for the ``interval`` policy)."""
        self._spawn(self._sweep_loop())
        if self.fsync == "interval":
            self._spawn(self._sync_loop())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def closing(self) -> bool:
        return self._closing

    def begin_shutdown(self) -> None:
        """Release live readers (long-poll, SSE) so connections can finish; appends still work."""
        self._closing = True
        for s in self.streams.values():
            s.notify()

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        for s in self.streams.values():
            s.notify()
            await s.log.close()
        await self.coordinator.close()
        self.executor.shutdown(wait=True)

    async def crash(self) -> None:
        """A seam for tests and tools: stop as ``kill -9`` would once everything staged reached the
        files. Background tasks are cancelled and the files closed, with no flush, no snapshot and no
        completion sync; a new ``Broker`` on the same directory then recovers from what is on disk.
        The broker is unusable afterwards (its streams are dropped, its executor shut down)."""
        for task in list(self._tasks):
            task.cancel()
        for s in self.streams.values():
            await s.log.drain()
            s.log.close_files()
        coord = self.coordinator.log
        assert coord is not None
        await coord.drain()
        coord.close_files()
        self.streams.clear()
        self.executor.shutdown(wait=True)

    def _open_log(self, directory: Path, base: Position) -> StreamLog:
        return StreamLog.open(
            directory,
            base,
            policy=self.fsync,
            segment_bytes=self.segment_bytes,
            executor=self.executor,
            fs=self.fs,
            clock=self.clock.time,
            io=self.io,
        )

    def _register(self, s: StreamState) -> None:
        self.streams[s.name] = s
        s.log.add_listener(s.notify)

    async def _sweep_loop(self) -> None:
        next_retention = self.clock.monotonic() + self.retention_interval
        while True:
            await asyncio.sleep(1.0)
            slices = _Slices()
            for s in list(self.streams.values()):
                await slices.pause()
                # after a pause, ``s`` may have been deleted (and its name, and so its directory,
                # taken by a new stream): only a stream still registered expires
                if self.streams.get(s.name) is s and not s.meta.soft_deleted and s.expired():
                    self._expire(s)
            if self.clock.monotonic() >= next_retention:
                next_retention = self.clock.monotonic() + self.retention_interval
                await self.enforce_retention()
            try:
                await self.coordinator.expire()
            except OSError as exc:
                log.error("could not abort expired transactions: %s", exc)
            try:
                await self.coordinator.maybe_compact()  # a failed compaction is given up inside
            except OSError as exc:  # ... unless not even the old log could be opened again
                log.error("the coordinator log could not be reopened after a failed compaction: %s", exc)

    async def _write_marker(self, stream: str, producer_id: str, epoch: int, txn: int, commit: bool) -> None:
        """Append a marker ending transaction ``txn`` (-1: unknown) of ``producer_id`` to ``stream``
        and wait until it is durable. The transaction number rides in the marker's sequence fields
        (markers move no sequences), so recovery can tell which transaction a stream saw end."""
        s = self.streams.get(stream)
        if s is None:
            return  # deleted since: its data went with it
        await self._stage_marker(s, producer_id, epoch, txn, commit).done

    @staticmethod
    def _stage_marker(s: StreamState, producer_id: str, epoch: int, txn: int, commit: bool) -> Staged:
        flags = FLAG_CONTROL | (FLAG_COMMIT if commit else 0) | (FLAG_JSON if s.is_json else 0)
        return s.log.stage(
            count=0, payload=b"", flags=flags, producer_id=producer_id, epoch=epoch, first_seq=txn, last_seq=txn
        )

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.fsync_interval)
            for s in list(self.streams.values()):
                with contextlib.suppress(OSError):
                    await s.log.sync()

    # ------------------------------------------------------------------ retention

    def retention_of(self, s: StreamState) -> tuple[int | None, int | None]:
        """The retention in force for ``s``, (seconds, bytes): its own, else the server's default."""
        m = s.meta
        return (
            m.retention_seconds if m.retention_seconds is not None else self.retention_seconds,
            m.retention_bytes if m.retention_bytes is not None else self.retention_bytes,
        )

    def retention_floor(self, s: StreamState) -> Position:
        """What retention must keep of ``s``: no segment that ends past this position may go.

        - Data of a transaction still open, and everything after it (the log's last stable offset):
          its commit would otherwise publish a transaction with parts missing.
        - Everything while the stream has forks: they read its data before their fork points.
        - Everything past the committed offset of each group the stream names
          (``Stream-Retention-Keep-Groups``), and everything while such a group has none for it."""
        if s.children:
            return s.log.first
        keep = s.log.txn.stable(s.log.durable.end)
        for group in s.meta.retention_keep_groups or ():
            token = self.coordinator.groups.get(group, {}).get(s.name)
            at = parse_token(token) if token is not None else None
            if at is None:
                return s.log.first
            if at.pos < keep.pos:
                keep = at
        return keep

    def _deletable(self, s: StreamState, now_ms: int) -> int:
        """How many of the oldest segments of ``s`` retention may delete now (0: none)."""
        seconds, max_bytes = self.retention_of(s)
        if (seconds is None and max_bytes is None) or s.deleted or s.meta.soft_deleted:
            return 0
        return s.log.deletable(
            now_ms=now_ms,
            max_age_ms=seconds * 1000 if seconds is not None else None,
            max_bytes=max_bytes,
            keep_from=self.retention_floor(s),
        )

    async def enforce_retention(self) -> dict[str, int]:
        """Delete the whole segments that retention lets go, in every stream (the sweep calls this
        every ``retention_interval`` seconds); returns the bytes freed per stream.

        In slices of the event loop (:data:`SWEEP_SLICE`): between two streams it lets other tasks
        run once a slice's time is used up. One stream's step on the loop is bounded by its reads:
        :meth:`~onceflow.storage.log.StreamLog.deletable` reads at most one segment's first header
        (on the PostgreSQL store a read bounded by its ``read_timeout``, storage/pgfs.py); the
        deletion's directory syncs run in worker threads."""
        now_ms = int(self.clock.time() * 1000)
        freed: dict[str, int] = {}
        slices = _Slices()
        for s in list(self.streams.values()):
            await slices.pause()  # a stream deleted meanwhile is skipped by _deletable (s.deleted)
            try:  # an I/O error is this stream's alone: the others, and the sweep, go on
                n = self._deletable(s, now_ms)
                if not n:
                    continue
                # asked again right before the deletion: a fork, a group's offset or the stream's
                # deletion may come while the log syncs its directory
                got = await s.log.delete_oldest(n, recheck=functools.partial(self._deletable, s, now_ms))
            except OSError as exc:  # e.g. a segment's first header unreadable; the next sweep tries again
                log.error("retention could not delete old segments of %r: %s", s.name, exc)
                continue
            if got:
                freed[s.name] = got
                log.info("retention deleted %d segment(s), %d bytes, of %r", n, got, s.name)
        return freed

    # ------------------------------------------------------------------ lookup

    def get(self, name: str) -> StreamState | None:
        """The stream at ``name`` (soft-deleted ones included), or None; expires lazily."""
        s = self.streams.get(name)
        if s is not None and not s.meta.soft_deleted and s.expired():
            self._expire(s)
            s = self.streams.get(name)
        return s

    def list(self, prefix: str = "") -> Iterator[StreamState]:
        for name in sorted(self.streams):
            s = self.streams[name]
            if name.startswith(prefix) and not s.meta.soft_deleted:
                yield s

    def _dir_for(self, name: str) -> Path:
        return self.streams_dir / hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:40]

    # ------------------------------------------------------------------ create

    async def forget_offsets_of_deleted(self, name: str) -> Outcome | None:
        """Before a stream is created under ``name``: drop the offsets into the stream of that name
        that was deleted or expired, the groups' and those in transactions (positions of that
        stream; a consumer resuming at one would skip the new stream's first messages). Nothing when
        a stream of that name exists (soft deleted included: its name is still taken). An Outcome
        when the drop could not be stored: the create must not go ahead. A create refused after
        this (its headers, the stream limit) has dropped them all the same: the stream they were
        positions of is gone either way."""
        if self.get(name) is not None or not self.coordinator.holds_offsets_of(name):
            return None  # get(): an expired stream not swept yet goes now, like a create would see it
        try:
            await self.coordinator.forget_stream(name)
        except OSError as exc:
            return Outcome(
                Refusal.UNAVAILABLE,
                detail=f"the consumer groups' offsets into the deleted stream {name!r} could not be dropped "
                f"before it is created again: {exc.strerror or exc}",
            )
        log.info("dropped the consumer groups' offsets into the deleted stream %r, created again", name)
        return None

    def create(
        self,
        name: str,
        *,
        content_type: str | None,
        ttl: str | None = None,
        expires_at: str | None = None,
        closed: bool = False,
        body: bytes = b"",
        fork_from: str | None = None,
        fork_offset: str | None = None,
        fork_sub_offset: str | None = None,
        retention: Retention | None = None,
    ) -> Outcome:
        """Create a stream, or confirm an identical one exists (PUT semantics)."""
        spec = self._create_spec(
            name,
            content_type=content_type,
            ttl=ttl,
            expires_at=expires_at,
            closed=closed,
            fork_from=fork_from,
            fork_offset=fork_offset,
            fork_sub_offset=fork_sub_offset,
        )
        if isinstance(spec, Outcome):
            return spec
        spec.retention = retention or Retention()
        existing = self.get(name)
        if existing is not None:
            return self._confirm_existing(existing, spec)
        if len(self.streams) >= self.max_streams:
            return Outcome(
                Refusal.LIMIT,
                detail=f"this server holds its limit of {self.max_streams} streams (onceflow serve --max-streams); "
                "delete streams or raise the limit",
            )
        fork = self._resolve_fork(spec)
        if isinstance(fork, Outcome):
            return fork
        return self._write_new_stream(spec, fork, body)

    def _create_spec(
        self,
        name: str,
        *,
        content_type: str | None,
        ttl: str | None,
        expires_at: str | None,
        closed: bool,
        fork_from: str | None,
        fork_offset: str | None,
        fork_sub_offset: str | None,
    ) -> _CreateSpec | Outcome:
        """Decides whether a create's name and headers are well formed, and parses them."""
        problem = validate_name(name)
        if problem:
            return Outcome(Refusal.BAD_REQUEST, detail=problem)
        if ttl is not None and expires_at is not None:
            return Outcome(Refusal.BAD_REQUEST, detail="give Stream-TTL or Stream-Expires-At, not both")
        ttl_seconds: int | None = None
        if ttl is not None:
            if not _TTL.match(ttl) or int(ttl) > MAX_SAFE_INT:
                return Outcome(
                    Refusal.BAD_REQUEST, detail=f"Stream-TTL must be a non-negative integer of seconds, got {ttl!r}"
                )
            ttl_seconds = int(ttl)
        expires_epoch: float | None = None
        if expires_at is not None:
            expires_epoch = _parse_rfc3339(expires_at)
            if expires_epoch is None:
                return Outcome(
                    Refusal.BAD_REQUEST, detail=f"Stream-Expires-At is not an RFC 3339 timestamp: {expires_at!r}"
                )
        sub_offset = 0
        if fork_sub_offset is not None:
            if fork_from is None:
                return Outcome(Refusal.BAD_REQUEST, detail="Stream-Fork-Sub-Offset requires Stream-Forked-From")
            if not _TTL.match(fork_sub_offset) or int(fork_sub_offset) > MAX_SAFE_INT:
                return Outcome(Refusal.BAD_REQUEST, detail="Stream-Fork-Sub-Offset must be a non-negative integer")
            sub_offset = int(fork_sub_offset)
        fork_pos: Position | None = None
        if fork_offset is not None:
            if fork_from is None:
                return Outcome(Refusal.BAD_REQUEST, detail="Stream-Fork-Offset requires Stream-Forked-From")
            fork_pos = parse_token(fork_offset)
            if fork_pos is None:
                return Outcome(Refusal.BAD_REQUEST, detail=f"Stream-Fork-Offset is not a valid offset: {fork_offset!r}")
            source = self.get(fork_from)
            if source is not None and source.past_final(fork_pos):
                fork_pos = source.tail
        if content_type is not None and not _CONTENT_TYPE.match(content_type.strip()):
            content_type = None
        return _CreateSpec(
            name=name,
            content_type=content_type,
            ttl_seconds=ttl_seconds,
            expires_at=expires_at,
            expires_epoch=expires_epoch,
            closed=closed,
            fork_from=fork_from,
            fork_pos=fork_pos,
            sub_offset=sub_offset,
            retention=Retention(),
        )

    @staticmethod
    def _confirm_existing(existing: StreamState, spec: _CreateSpec) -> Outcome:
        """Decides whether a create at a taken name repeats the existing stream's configuration."""
        if existing.meta.soft_deleted:
            return Outcome(
                Refusal.CONFIG_CONFLICT,
                detail="a deleted stream with live forks still holds this name; delete its forks first",
            )
        m = existing.meta
        want_ct = spec.content_type or (m.content_type if spec.fork_from else "application/octet-stream")
        expiry_same = (spec.ttl_seconds, spec.expires_at) == (m.ttl_seconds, m.expires_at) or (
            m.expiry_inherited and spec.ttl_seconds is None and spec.expires_at is None
        )
        same = (
            normalize_content_type(want_ct) == normalize_content_type(m.content_type)
            and expiry_same
            and spec.closed == existing.closed
            and spec.fork_from == m.fork_parent
            and (spec.fork_pos is None or spec.fork_pos == m.base)
            and spec.sub_offset == m.fork_sub_offset
            and spec.retention == Retention.of(m)
        )
        if same:
            return Outcome("exists", stream=existing, next=existing.tail, closed=existing.closed)
        return Outcome(
            Refusal.CONFIG_CONFLICT,
            stream=existing,
            detail="a stream with a different configuration exists at this name",
        )

    def _resolve_fork(self, spec: _CreateSpec) -> _Fork | Outcome:
        """Decides whether a new stream may fork where it asks to, and what it takes from its source
        (content type, base, a sub-offset prefix, an inherited expiry); a plain create forks nothing."""
        if spec.fork_from is None:
            return _Fork(parent=None, base=ZERO, prefix=None)
        parent = self.get(spec.fork_from)
        if parent is None:
            return Outcome(Refusal.NOT_FOUND, detail=f"the stream to fork, {spec.fork_from!r}, does not exist")
        if parent.meta.soft_deleted:
            return Outcome(Refusal.CONFIG_CONFLICT, detail=f"the stream to fork, {spec.fork_from!r}, was deleted")
        if spec.content_type is not None and normalize_content_type(spec.content_type) != normalize_content_type(
            parent.meta.content_type
        ):
            return Outcome(Refusal.CONFIG_CONFLICT, detail="a fork's content type must match its source's")
        spec.content_type = parent.meta.content_type
        base = spec.fork_pos if spec.fork_pos is not None else parent.tail
        if base > parent.tail or base.pos > parent.tail.pos:
            return Outcome(Refusal.BAD_REQUEST, detail="Stream-Fork-Offset is beyond the end of the source stream")
        try:
            parent.check_position(base)
        except InvalidPosition as exc:
            return Outcome(Refusal.BAD_REQUEST, detail=f"Stream-Fork-Offset: {exc}")
        prefix: tuple[bytes, int] | None = None
        if spec.sub_offset:
            prefix_or_error = self._fork_prefix(parent, base, spec.sub_offset)
            if isinstance(prefix_or_error, Outcome):
                return prefix_or_error
            prefix = prefix_or_error
        fork = _Fork(parent=parent, base=base, prefix=prefix)
        if spec.ttl_seconds is None and spec.expires_at is None:
            fork.inherited = True
            spec.ttl_seconds = parent.meta.ttl_seconds
            spec.expires_at, spec.expires_epoch = parent.meta.expires_at, parent.meta.expires_at_epoch
        return fork

    def _write_new_stream(self, spec: _CreateSpec, fork: _Fork, body: bytes) -> Outcome:
        """Decides the new stream's first batches (fork prefix, body, close) and writes them and
        its meta to a fresh directory; a disk error leaves nothing behind."""
        content_type = spec.content_type or "application/octet-stream"
        is_json = normalize_content_type(content_type) == "application/json"

        payload, count = body, 1
        if is_json and body:
            try:
                payload, count = encode_messages(body, allow_empty=True)
            except JsonError as exc:
                return Outcome(Refusal.BAD_REQUEST, detail=str(exc))
        elif not body:
            count = 0

        base, prefix = fork.base, fork.prefix
        meta = StreamMeta(
            name=spec.name,
            content_type=content_type,
            created_ms=int(self.clock.time() * 1000),
            ttl_seconds=spec.ttl_seconds,
            expires_at=spec.expires_at,
            expires_at_epoch=spec.expires_epoch,
            fork_parent=spec.fork_from,
            fork_offset=(base.offset, base.pos) if spec.fork_from is not None else None,
            fork_sub_offset=spec.sub_offset,
            expiry_inherited=fork.inherited,
            retention_seconds=spec.retention.seconds,
            retention_bytes=spec.retention.bytes,
            retention_keep_groups=list(spec.retention.keep_groups) if spec.retention.keep_groups is not None else None,
        )
        directory = self._dir_for(spec.name)
        # On the loop, as the whole create (so no other request sees it half made): on the PostgreSQL
        # store its look-ups (exists, the new log's listing) are reads bounded by the store's
        # read_timeout, and its writes (directory, first segment and its sync, meta) by its
        # write_timeout: past it, the create's outcome is unknown (storage/pgfs.py).
        if self.fs.exists(directory):  # debris of an expired or unfinished stream
            self._trash(directory)
        flags = FLAG_JSON if is_json else 0
        try:
            slog = self._open_log(directory, base)
            initial = [(p, c, flags) for p, c in ([prefix] if prefix else []) if c or p]
            if count:
                initial.append((payload, count, flags))
            if spec.closed:
                if initial:
                    p, c, f = initial[-1]
                    initial[-1] = (p, c, f | FLAG_CLOSE)
                else:
                    initial.append((b"", 0, flags | FLAG_CLOSE))
            slog.write_initial(initial)
            write_meta(self.fs, directory, meta)
        except OSError as exc:
            self.fs.rmtree(directory)
            return unstored("create", exc, refused="could not create the stream on disk")
        parent = fork.parent
        stream = StreamState(meta, directory, slog, parent=parent, clock=self.clock)
        if parent is not None:
            parent.children[stream] = None
        self._register(stream)
        return Outcome("created", stream=stream, next=stream.tail, closed=stream.closed)

    @staticmethod
    def _fork_prefix(parent: StreamState, base: Position, sub: int) -> tuple[bytes, int] | Outcome:
        """The first ``sub`` messages (JSON) or bytes of the batch at ``base`` in ``parent``, which
        a sub-offset fork copies into its own log as plain data, byte for byte.

        Data of a transaction is copied only once committed: while it is open the answer is a
        ``txn_refused`` (409, retry once it ended); aborted data is no data (400, as for a
        sub-offset past the data)."""
        batches = parent.read_range(base, 1) if base.pos < parent.tail.pos else []
        if not batches:
            return Outcome(
                Refusal.BAD_REQUEST, detail="Stream-Fork-Sub-Offset points past the end of the source stream"
            )
        batch = batches[0]
        if parent.is_open_txn(batch):
            return Outcome(
                Refusal.TXN_REFUSED,
                detail="Stream-Fork-Sub-Offset names data of a transaction that is still open; "
                "fork there once it has committed, or fork at Stream-Fork-Offset alone",
            )
        if parent.is_aborted(batch):
            return Outcome(
                Refusal.BAD_REQUEST,
                detail="Stream-Fork-Sub-Offset names data of an aborted transaction, which is no data",
            )
        payload = batch.payload
        if parent.is_json:
            if sub > batch.header.count:
                return Outcome(Refusal.BAD_REQUEST, detail="Stream-Fork-Sub-Offset is past the next message boundary")
            try:
                return first_messages(payload, sub), sub
            except JsonError as exc:  # only a damaged log; never what an append stored
                log.error("stream %r: the batch at %s does not split into messages: %s", parent.name, base.token(), exc)
                return Outcome(
                    Refusal.UNAVAILABLE, detail=f"the source stream's data at Stream-Fork-Offset cannot be split: {exc}"
                )
        if sub > len(payload):
            return Outcome(Refusal.BAD_REQUEST, detail="Stream-Fork-Sub-Offset is past the next data boundary")
        return payload[:sub], 1

    # ------------------------------------------------------------------ append / close

    def _live(self, name: str) -> StreamState | Outcome:
        s = self.get(name)
        if s is None:
            return Outcome(Refusal.NOT_FOUND, detail=f"no stream named {name!r}")
        if s.meta.soft_deleted:
            return Outcome(Refusal.GONE, detail=f"stream {name!r} was deleted")
        return s

    async def append(
        self,
        name: str,
        body: bytes,
        *,
        content_type: str | None,
        close: bool = False,
        producer: ProducerHeaders | None = None,
        stream_seq: str | None = None,
        if_match: Position | None = None,
        transactional_id: str | None = None,
        commit_txn: int | None = None,
    ) -> Outcome:
        """Append ``body`` (and/or close the stream). Resolves once the batch is durable.

        With ``transactional_id`` the append joins that id's open transaction (starting one if
        none is open): its data is invisible to read_committed readers until the commit marker.
        With ``commit_txn`` as well, it is that transaction's last append and commits it
        (:meth:`_append_and_commit`).

        Requests of one producer can arrive out of order (a pipelining client uses several
        connections). A request at most ``REORDER_WINDOW`` sequence numbers ahead therefore waits up
        to ``reorder_wait`` seconds for the ones before it to be staged, and is validated afresh each
        time one is; only then is it a 409 gap. This is the per-(stream, producer) serialisation the
        protocol asks for, and it spares the client a resend.

        A transactional append that repeats one the stream already holds (same epoch, a sequence
        number at or below the producer's last there) is answered as the duplicate it is, before
        and without the coordinator (:meth:`_transactional_duplicate`): the delayed original of an
        append whose transaction has ended must not begin the next transaction. So is one to a
        closed stream (``stream_closed``). ``Producer-Id: txn:<id>`` is reserved for appends with
        ``Transaction-Id``: a plain append under it would use up the transactional producer's
        sequence numbers.
        """
        txn_number: int | None = None
        if transactional_id is not None:
            if producer is None:
                return Outcome(
                    Refusal.BAD_REQUEST,
                    detail="a transactional append needs Producer-Id, Producer-Epoch and Producer-Seq",
                )
            expected_pid = TXN_PRODUCER_PREFIX + transactional_id
            if producer.producer_id != expected_pid:
                return Outcome(
                    Refusal.BAD_REQUEST,
                    detail=f"a transactional append of {transactional_id!r} must use Producer-Id {expected_pid}",
                )
            if close:
                return Outcome(Refusal.BAD_REQUEST, detail="a stream cannot be closed inside a transaction")
            found = self._live(name)
            if isinstance(found, Outcome):
                return found
            try:
                self.coordinator.current(transactional_id, producer.epoch)  # fenced or unknown: refused first
            except TxnError as exc:
                return txn_outcome(exc)
            if found.log.pending.closed:
                return Outcome(
                    Refusal.STREAM_CLOSED,
                    stream=found,
                    next=found.log.pending.end,
                    closed=True,
                    detail="the stream is closed",
                )
            prior = found.log.producer(producer.producer_id)
            if prior is not None and prior.epoch == producer.epoch and producer.seq <= prior.last_seq:
                answered = await self._transactional_duplicate(found, producer, transactional_id, commit_txn)
                if answered is not None:
                    return answered
            try:
                meta = await self.coordinator.begin_write(transactional_id, producer.epoch, name, commit=commit_txn)
            except TxnError as exc:
                return txn_outcome(exc)
            if meta is None:
                assert commit_txn is not None
                return await self._committed_retry(found, producer, transactional_id, commit_txn)
            txn_number = meta.txn
        elif commit_txn is not None:
            return Outcome(
                Refusal.BAD_REQUEST,
                detail="Transaction-Commit needs Transaction-Id (and Producer-Id, Producer-Epoch, Producer-Seq)",
            )
        elif producer is not None and producer.producer_id.startswith(TXN_PRODUCER_PREFIX):
            return Outcome(
                Refusal.BAD_REQUEST,
                detail=f"Producer-Id {producer.producer_id!r} is reserved for transactional appends: "
                "send Transaction-Id with it, or use another producer id",
            )
        deadline: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            if (
                deadline is not None
                and transactional_id is not None
                and txn_number is not None
                and producer is not None
                and not self.coordinator.still_open(transactional_id, producer.epoch, txn_number, name)
            ):
                # it waited for earlier sequence numbers and the transaction ended meanwhile: its
                # data must not land after the transaction's marker, outside any transaction
                return Outcome(
                    Refusal.TXN_REFUSED,
                    txn=txn_number,
                    detail=f"transaction {txn_number} of {transactional_id!r} ended while this append waited",
                )
            if commit_txn is not None:
                assert producer is not None and transactional_id is not None
                outcome = await self._append_and_commit(
                    name,
                    body,
                    content_type=content_type,
                    producer=producer,
                    stream_seq=stream_seq,
                    if_match=if_match,
                    tid=transactional_id,
                    txn=commit_txn,
                )
            else:
                outcome = await self._append_once(
                    name,
                    body,
                    content_type=content_type,
                    close=close,
                    producer=producer,
                    stream_seq=stream_seq,
                    if_match=if_match,
                    transactional=txn_number is not None,
                )
            if txn_number is not None and outcome.kind in ("appended", "duplicate"):
                return replace(outcome, txn=txn_number)
            s = outcome.stream
            if producer is None or s is None or outcome.kind not in ("sequence_gap", "invalid_epoch_seq"):
                return outcome
            expected = outcome.expected_seq if outcome.kind == "sequence_gap" else 0
            if producer.seq - (expected or 0) > REORDER_WINDOW or self.reorder_wait <= 0:
                return outcome
            if deadline is None:
                deadline = loop.time() + self.reorder_wait
            remaining = deadline - loop.time()
            if remaining <= 0:
                return outcome
            fut: asyncio.Future[None] = loop.create_future()
            s.staged_waiters[fut] = None
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                return outcome
            finally:
                s.staged_waiters.pop(fut, None)

    async def _append_and_commit(
        self,
        name: str,
        body: bytes,
        *,
        content_type: str | None,
        producer: ProducerHeaders,
        stream_seq: str | None,
        if_match: Position | None,
        tid: str,
        txn: int,
    ) -> Outcome:
        """The last append of transaction ``txn`` of ``tid``, committing it (``Transaction-Commit``).

        A transaction that wrote only to this stream and carries no group offsets is committed by
        its marker alone: the marker is staged right behind the data, so both reach the disk in
        one write and one fsync, with no decision record (a marker is atomic by itself; recovery
        learns of such a commit from the marker, see ``Coordinator.recover``). Anything larger
        takes the ordinary commit once the data is durable: the decision record, then markers.
        The id's lock is held from the checks to the fsync, so nothing else ends the transaction
        in between."""
        coord = self.coordinator
        async with coord.holding(tid):
            meta = coord.txns.get(tid)  # None: an operator deleted the id while this waited
            if meta is None:
                return txn_outcome(coord.unknown(tid))
            if meta.epoch == producer.epoch and meta.txn == txn and meta.status is TxnStatus.COMPLETE_COMMIT:
                found = self._live(name)
                if isinstance(found, Outcome):
                    return found
                return await self._committed_retry(found, producer, tid, txn)  # committed while this waited
            if not coord.still_open(tid, producer.epoch, txn, name):
                return Outcome(
                    Refusal.TXN_REFUSED, txn=txn, detail=f"transaction {txn} of {tid!r} ended while this append waited"
                )
            marker: list[Staged] = []

            def commit_too(s: StreamState) -> None:
                if coord.one_stream(meta, txn, name):
                    marker.append(self._stage_marker(s, meta.producer_id, meta.epoch, txn, True))

            outcome = await self._append_once(
                name,
                body,
                content_type=content_type,
                close=False,
                producer=producer,
                stream_seq=stream_seq,
                if_match=if_match,
                transactional=True,
                after_stage=commit_too,
            )
            if outcome.kind == "appended" and marker:
                await marker[0].done  # written and synced with the data: already done
                coord.commit_by_marker(meta)
                return replace(outcome, committed=True)
            if outcome.kind not in ("appended", "duplicate"):
                return outcome
            if outcome.kind == "duplicate" and coord.one_stream(meta, txn, name):
                # a retry whose first attempt stored the data but not the marker (or lost its answer first)
                assert outcome.stream is not None
                try:
                    await self._stage_marker(outcome.stream, meta.producer_id, meta.epoch, txn, True).done
                except OSError as exc:
                    return unstored("commit", exc, stream=outcome.stream)
                coord.commit_by_marker(meta)
                return replace(outcome, committed=True)
        try:
            await coord.end(tid, producer.epoch, txn, commit=True)
        except TxnError as exc:  # also a decision logged whose markers failed: retriable, see Coordinator.end
            return txn_outcome(exc)
        except OSError as exc:
            return unstored("commit", exc, stream=outcome.stream, refused="the data was stored, the commit was not")
        return replace(outcome, committed=True)

    async def _transactional_duplicate(
        self, s: StreamState, producer: ProducerHeaders, tid: str, commit_txn: int | None
    ) -> Outcome | None:
        """Answer a transactional append that ``s`` already holds (same epoch, a sequence number at
        or below the producer's last there) without beginning or changing any transaction.

        - Without ``Transaction-Commit``: the duplicate's answer, carrying ``Transaction-Number``
          only while the transaction it belongs to is still open in ``s`` (the client compares
          it with its own); one whose transaction has ended there carries none. While the id's
          last decision is being finished it is refused as retriable, and once its epoch is
          fenced, as fenced.
        - The retry of the last append of transaction ``commit_txn``: committed already, it is
          answered committed; its commit decided but unfinished (a marker failed), the retry
          finishes it first, as a retry of ``/commit`` would; still open, None: the ordinary path
          commits it (its data is there, maybe not its marker).
        - Any other ``Transaction-Commit``: refused (``409``; retriable while the id's last
          decision is being completed); a duplicate can begin no transaction."""
        coord = self.coordinator
        meta = coord.txns.get(tid)
        if meta is None:
            return txn_outcome(coord.unknown(tid))
        if commit_txn is not None:
            if commit_txn == meta.txn:
                if meta.status is TxnStatus.ONGOING and s.name in meta.streams:
                    return None
                if meta.status is TxnStatus.PREPARE_COMMIT:
                    try:
                        await coord.end(tid, producer.epoch, commit_txn, commit=True)
                    except TxnError as exc:
                        return txn_outcome(exc)
                    except OSError as exc:
                        return unstored("commit", exc, stream=s, refused="the commit could not be finished")
                    return await self._committed_retry(s, producer, tid, commit_txn)
                if meta.status is TxnStatus.COMPLETE_COMMIT:
                    return await self._committed_retry(s, producer, tid, commit_txn)
            try:
                coord.refuse_while_completing(meta)
            except TxnError as exc:
                return txn_outcome(exc)
            return Outcome(
                Refusal.TXN_REFUSED,
                txn=meta.txn,
                detail=f"this append was stored before, it cannot commit transaction {commit_txn} "
                f"of {tid!r} (the current one is {meta.txn}, {meta.status.value})",
            )
        outcome = await self._settle_duplicate(s, producer, closed=False)
        if outcome.kind != "duplicate":
            return outcome
        meta = coord.txns.get(tid)
        if meta is None:
            return txn_outcome(coord.unknown(tid))
        try:
            # its transaction's decision is being finished (an abort of the sweep's may end in a
            # fence): the plain duplicate's answer would let the producer take its append as
            # stored in an open transaction; once the decision is finished, a retry learns which
            coord.refuse_while_completing(meta)
            coord.current(tid, producer.epoch)  # fenced while it waited: say so
        except TxnError as exc:
            return txn_outcome(exc)
        return replace(outcome, txn=self._open_transaction_of(s, producer, meta))

    @staticmethod
    def _open_transaction_of(s: StreamState, producer: ProducerHeaders, meta: TxnMeta) -> int | None:
        """The number of the transaction a durable duplicate in ``s`` belongs to if that
        transaction is still open there, else None (it ended there, or it is too old to tell)."""
        if meta.epoch != producer.epoch or meta.status not in (
            TxnStatus.ONGOING,
            TxnStatus.PREPARE_COMMIT,
            TxnStatus.PREPARE_ABORT,
        ):
            return None
        state = s.log.producer(producer.producer_id)
        entry = state.find(producer.seq) if state is not None else None
        began = s.log.txn.open.get(producer.producer_id)
        if entry is None or began is None or s.name not in meta.streams:
            return None
        return meta.txn if entry.start.pos >= began.pos else None

    async def _committed_retry(self, s: StreamState, producer: ProducerHeaders, tid: str, txn: int) -> Outcome:
        """An append naming a transaction that already committed: only a retry of one of its
        appends (a duplicate) is answered, as committed; anything else would land outside it."""
        state = s.log.producer(producer.producer_id)
        if state is not None and state.epoch == producer.epoch and producer.seq <= state.last_seq:
            outcome = await self._settle_duplicate(s, producer, closed=False)
            return replace(outcome, txn=txn, committed=outcome.kind == "duplicate")
        return Outcome(
            Refusal.TXN_REFUSED,
            txn=txn,
            detail=f"transaction {txn} of {tid!r} is already committed; this append is not part of it",
        )

    async def _append_once(
        self,
        name: str,
        body: bytes,
        *,
        content_type: str | None,
        close: bool,
        producer: ProducerHeaders | None,
        stream_seq: str | None,
        if_match: Position | None,
        transactional: bool = False,
        after_stage: Callable[[StreamState], None] | None = None,
    ) -> Outcome:
        found = self._live(name)
        if isinstance(found, Outcome):
            return found
        s = found
        s.touch()
        # The checks and the staging run without yielding to the loop in between (the helpers await
        # only on the paths that answer), so no other append slips between a check and its stage.
        refused = await self._check_append(
            s, body, content_type=content_type, close=close, producer=producer, if_match=if_match
        )
        if refused is not None:
            return refused
        sseq = stream_seq.encode() if stream_seq is not None else None
        pending = s.log.pending
        # Step 5: Stream-Seq must grow strictly (byte-wise).
        if sseq is not None and pending.stream_seq is not None and sseq <= pending.stream_seq:
            return Outcome(
                Refusal.STREAM_SEQ_CONFLICT,
                stream=s,
                detail=f"Stream-Seq {stream_seq!r} is not greater than the last one",
            )
        framed = self._frame_append(s, body, close=close, transactional=transactional)
        if isinstance(framed, Outcome):
            return framed
        return await self._stage_append(
            s, framed, body, close=close, producer=producer, sseq=sseq, after_stage=after_stage
        )

    async def _check_append(
        self,
        s: StreamState,
        body: bytes,
        *,
        content_type: str | None,
        close: bool,
        producer: ProducerHeaders | None,
        if_match: Position | None,
    ) -> Outcome | None:
        """Decides whether an append may go ahead on ``s`` (steps 1-4); the answer if not, else None."""
        pending = s.log.pending
        # Step 1: a closed stream accepts only a retry of the request that closed it.
        if pending.closed:
            if producer is not None and pending.closed_by == (producer.producer_id, producer.epoch, producer.seq):
                return await self._settle_duplicate(s, producer, closed=True)
            if close and not body and producer is None:
                await self._await_end(s, pending.end)
                return Outcome("already_closed", stream=s, next=pending.client_end, closed=True)
            return Outcome(
                Refusal.STREAM_CLOSED, stream=s, next=pending.client_end, closed=True, detail="the stream is closed"
            )

        # Step 2: the content type must match (not checked for close-only requests).
        if body and content_type != s.meta.content_type and normalize_content_type(content_type) != s.media_type:
            return Outcome(
                Refusal.CONTENT_TYPE_MISMATCH,
                stream=s,
                detail=f"this stream holds {s.meta.content_type}, the request sent {content_type}",
            )

        # Step 3: idempotent producer validation (client-declared epoch, server-validated).
        if producer is not None:
            refused = await self._check_producer(s, producer)
            if refused is not None:
                return refused

        # Step 4: optimistic concurrency (If-Match names the tail the writer expects).
        if if_match is not None and if_match != pending.end:
            return Outcome(
                Refusal.TAIL_MISMATCH,
                stream=s,
                next=pending.end,
                detail="the stream's tail is not the one given in If-Match",
            )
        return None

    async def _check_producer(self, s: StreamState, producer: ProducerHeaders) -> Outcome | None:
        """Decides whether a producer's (epoch, seq) is the next one on ``s``: a retry is answered as
        its original, a stale epoch or a gap is refused, the next one gets None."""
        state = s.log.producer(producer.producer_id)
        if state is not None:
            if producer.epoch < state.epoch:
                return Outcome(
                    Refusal.STALE_EPOCH,
                    stream=s,
                    epoch=state.epoch,
                    detail="stale producer epoch: a newer epoch has claimed this producer id",
                )
            if producer.epoch == state.epoch and producer.seq <= state.last_seq:
                return await self._settle_duplicate(s, producer, closed=False)
            if producer.epoch == state.epoch and producer.seq > state.last_seq + 1:
                return Outcome(
                    Refusal.SEQUENCE_GAP,
                    stream=s,
                    expected_seq=state.last_seq + 1,
                    received_seq=producer.seq,
                    detail=f"producer sequence gap: expected {state.last_seq + 1}, got {producer.seq}",
                )
        if (state is None or producer.epoch > state.epoch) and producer.seq != 0:
            if state is None:
                return Outcome(
                    Refusal.SEQUENCE_GAP,
                    stream=s,
                    expected_seq=0,
                    received_seq=producer.seq,
                    detail=f"producer sequence gap: a new producer starts at 0, got {producer.seq}",
                )
            return Outcome(Refusal.INVALID_EPOCH_SEQ, stream=s, detail="a new producer epoch must start at sequence 0")
        return None

    @staticmethod
    def _frame_append(
        s: StreamState, body: bytes, *, close: bool, transactional: bool
    ) -> tuple[bytes, int, int] | Outcome:
        """Decides an append's payload, message count and flags (step 6; ``transactional``: the batch is a
        transaction's, ``FLAG_TXN``); a malformed JSON body is refused."""
        payload, count, flags = body, (1 if body else 0), 0
        if s.is_json:
            flags |= FLAG_JSON
            if body:
                try:
                    payload, count = encode_messages(body, allow_empty=False)
                except JsonError as exc:
                    return Outcome(Refusal.BAD_REQUEST, stream=s, detail=str(exc))
        if close:
            flags |= FLAG_CLOSE
        if transactional:
            flags |= FLAG_TXN
        return payload, count, flags

    async def _stage_append(
        self,
        s: StreamState,
        framed: tuple[bytes, int, int],
        body: bytes,
        *,
        close: bool,
        producer: ProducerHeaders | None,
        sseq: bytes | None,
        after_stage: Callable[[StreamState], None] | None,
    ) -> Outcome:
        """Stages a checked append at the pending tail and decides its answer once it is durable (step 7)."""
        payload, count, flags = framed
        staged = s.log.stage(
            count=count,
            payload=payload,
            flags=flags,
            producer_id=producer.producer_id if producer else None,
            epoch=producer.epoch if producer else -1,
            first_seq=producer.seq if producer else -1,
            last_seq=producer.seq if producer else -1,
            stream_seq=sseq,
        )
        if after_stage is not None:
            after_stage(s)  # e.g. a commit marker, into the same write as the data
        if s.staged_waiters:
            s.notify_staged()
        try:
            await staged.done
        except OSError as exc:
            return unstored("append", exc, stream=s)
        kind: OutcomeKind = "closed_now" if close and not body else "appended"
        return Outcome(
            kind,
            stream=s,
            next=staged.start if kind == "closed_now" else staged.end,  # a close takes no offset space
            closed=close,
            epoch=producer.epoch if producer else None,
            seq=producer.seq if producer else None,
        )

    async def _await_end(self, s: StreamState, end: Position) -> None:
        """Wait until ``end`` is durable (a retry may overtake the original's fsync)."""
        while s.log.durable.end.pos < end.pos and s.log.pending.end.pos >= end.pos and not s.deleted:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            s.waiters[fut] = None
            await fut

    async def _settle_duplicate(self, s: StreamState, producer: ProducerHeaders, *, closed: bool) -> Outcome:
        """Answer a retry with the original's result, once the original is durable."""
        state = s.log.producer(producer.producer_id)
        assert state is not None
        entry = state.find(producer.seq)
        end = entry.end if entry is not None else s.log.pending.end
        await self._await_end(s, end)
        durable = s.log.durable_producer(producer.producer_id)
        if durable is None or (durable.epoch, durable.last_seq) < (producer.epoch, producer.seq):
            return Outcome(Refusal.UNAVAILABLE, stream=s, detail="the original append failed; retry it")
        nxt = entry.end if entry is not None else s.tail
        if nxt.pos > s.tail.pos:  # the request that closed the stream without data: the tail it left
            nxt = s.tail
        return Outcome(
            "duplicate",
            stream=s,
            next=nxt,
            closed=closed or s.closed,
            epoch=producer.epoch,
            seq=durable.last_seq if durable.epoch == producer.epoch else producer.seq,
        )

    # ------------------------------------------------------------------ delete

    def delete(self, name: str) -> Outcome:
        found = self._live(name)
        if isinstance(found, Outcome):
            return found
        try:
            self._delete(found)
        except OSError as exc:
            return unstored("delete", exc)
        return Outcome("deleted")

    def _delete(self, s: StreamState) -> None:
        """Delete ``s`` (soft while it has forks). Raises OSError, changing nothing, when the delete
        cannot be stored: a delete that was answered must survive a restart (and a power loss)."""
        if s.forks > 0:
            s.meta.soft_deleted = True
            try:
                write_meta(self.fs, s.directory, s.meta)
            except OSError:
                s.meta.soft_deleted = False
                raise
            s.notify()
            return
        unsynced = self._trash(s.directory, required=True)  # raises when nothing moved
        self.streams.pop(s.name, None)
        s.deleted = True
        s.log.close_files()
        s.notify()
        for told in self.on_delete:  # whoever keeps something by a stream's name lets go of it
            told(s.name)
        parent = s.parent
        if parent is not None:
            parent.children.pop(s, None)
            if not parent.children and parent.meta.soft_deleted:
                try:
                    self._delete(parent)
                except OSError as exc:  # it stays soft deleted; the next start deletes it
                    log.error("could not delete %r, whose last fork went: %s", parent.name, exc)
        if unsynced is not None:
            raise unsynced  # gone, but maybe not for good: not "deleted" (a retry gets 404)

    def _expire(self, s: StreamState) -> None:
        log.info("stream %r expired", s.name)
        try:
            self._delete(s)
        except OSError as exc:  # the sweep tries again
            log.error("could not delete the expired stream %r: %s", s.name, exc)

    def _trash(self, directory: Path, *, required: bool = False) -> OSError | None:
        """Move ``directory`` to the trash (removed in the background). A failed move raises with
        ``required`` (nothing moved) and is logged otherwise (debris that can wait). Returns the
        error of a sync that failed after the move: moved, but maybe not durably."""
        target = self.trash_dir / f"{directory.name}-{uuid.uuid4().hex}"
        try:
            # on the loop (a delete is answered only once it is stored): on the PostgreSQL store a
            # write bounded by its write_timeout (storage/pgfs.py); the rmtree below runs in a
            # worker thread
            self.fs.rename(directory, target)
        except OSError as exc:
            if required:
                raise
            log.error("could not move %s to the trash: %s", directory, exc)
            return None
        unsynced: OSError | None = None
        try:  # a delete that was answered must not be undone by a power loss
            self.fs.sync_dir(directory.parent)
            self.fs.sync_dir(self.trash_dir)
        except OSError as exc:
            unsynced = exc
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.fs.rmtree(target)
            return unsynced
        loop.run_in_executor(self.executor, self.fs.rmtree, target)
        return unsynced

    # ------------------------------------------------------------------ reads

    def resolve_start(self, s: StreamState, offset: str | None, *, committed: bool = True) -> Position | str:
        """The position a read's ``offset`` parameter names, or what is wrong with it; raises
        :class:`OffsetGone` for an offset whose data retention deleted."""
        at, check = self._start_of(s, offset, committed)
        if check:
            assert isinstance(at, Position)
            try:
                s.check_position(at)
            except InvalidPosition as exc:
                return str(exc)
        return at

    async def aresolve_start(self, s: StreamState, offset: str | None, *, committed: bool = True) -> Position | str:
        """:meth:`resolve_start` for a client's read: the check that an offset is a batch boundary
        (a read of that batch) is awaited (:meth:`StreamState.acheck_position`). Raises as
        :meth:`aread` does when the stream's data goes meanwhile."""
        at, check = self._start_of(s, offset, committed)
        if check:
            assert isinstance(at, Position)
            try:
                await s.acheck_position(at)
            except InvalidPosition as exc:
                if isinstance(exc, OffsetGone):
                    raise OffsetGone(at, s.earliest) from None
                return str(exc)
        return at

    @staticmethod
    def _start_of(s: StreamState, offset: str | None, committed: bool) -> tuple[Position | str, bool]:
        """:meth:`resolve_start`'s answer, and whether it must still be checked to be a batch boundary."""
        if offset is None or offset == "-1":
            return s.earliest, False
        if offset == "now":
            return (s.tail if not committed else s.stable()), False
        at = parse_token(offset)
        if at is None:
            return f"offset {offset!r} is not an offset this server issued", False
        if s.past_final(at):
            return s.tail, False
        if at.pos > s.tail.pos or at.offset > s.tail.offset:
            return f"offset {offset!r} is beyond the end of the stream", False
        if at.pos < s.earliest.pos:
            raise OffsetGone(at, s.earliest)
        return at, True

    @staticmethod
    def visible_end(s: StreamState, committed: bool = True) -> Position:
        """Where reads end: the last stable offset for read_committed, else the durable tail."""
        return s.stable() if committed else s.tail

    def read(
        self,
        s: StreamState,
        at: Position,
        max_bytes: int | None = None,
        *,
        committed: bool = True,
        until: Position | None = None,
        max_records: int | None = None,
    ) -> ReadResult:
        """Durable data from ``at``: at most about ``max_bytes`` (server default otherwise).

        read_committed (the default) stops at the last stable offset and leaves out the data of
        aborted transactions; ``next`` still moves past what was left out. ``until`` and
        ``max_records`` bound the read further (at least one batch is returned when there is any):
        readers that replay exact ranges, such as the Spark source, read the same batches twice.
        """
        end = self._read_end(s, at, committed, until)
        batches: list[ReadBatch] = []
        if at.pos < end.pos:
            try:
                batches = s.read_range(at, max_bytes or self.max_read_bytes, end)
            except CorruptBatch as exc:  # only reachable through a forged offset
                raise _not_a_boundary(s, at, exc) from None
        return _read_result(s, at, end, batches, committed, max_records)

    async def aread(
        self,
        s: StreamState,
        at: Position,
        max_bytes: int | None = None,
        *,
        committed: bool = True,
        until: Position | None = None,
        max_records: int | None = None,
    ) -> ReadResult:
        """:meth:`read` for a client's read, the same answer: the logs' reads are awaited
        (:meth:`StreamState.aread_range`), so a read that waits for the PostgreSQL store's database
        holds up no other request; a read the memory or the local disk serves awaits nothing.

        What it returns is the stream as it was when the read began (its end is fixed then, and the
        bytes below it never change). Retention deleting what it was reading meanwhile raises
        :class:`OffsetGone` (from the earliest offset kept then), as a read begun after it would;
        the stream deleted, or the server stopping, raises ``LogClosed`` (the caller answers as it
        would a read of a stream that is not there)."""
        end = self._read_end(s, at, committed, until)
        batches: list[ReadBatch] = []
        if at.pos < end.pos:
            try:
                batches = await s.aread_range(at, max_bytes or self.max_read_bytes, end)
            except OffsetGone:
                raise OffsetGone(at, s.earliest) from None
            except CorruptBatch as exc:  # only reachable through a forged offset
                raise _not_a_boundary(s, at, exc) from None
        return _read_result(s, at, end, batches, committed, max_records)

    def _read_end(self, s: StreamState, at: Position, committed: bool, until: Position | None) -> Position:
        """Where a read from ``at`` ends (:meth:`visible_end`, or ``until`` before it); raises
        :class:`OffsetGone` for a reader retention overtook."""
        end = self.visible_end(s, committed)
        if until is not None and until.pos < end.pos:
            end = until
        if at.pos < s.earliest.pos:
            raise OffsetGone(at, s.earliest)  # a reader retention overtook
        return end

    async def boundaries(
        self,
        s: StreamState,
        at: Position,
        until: Position | None,
        *,
        every: int,
        max_records: int | None = None,
        committed: bool = True,
    ) -> tuple[Sequence[Position], Position]:
        """Batch boundaries after ``at``, at least ``every`` records apart, and where a read of at
        most ``max_records`` records (at least one batch) that stops at ``until`` ends.

        The range is read about 4 MiB at a time (on the PostgreSQL store, each a query within its
        read_timeout, awaited: :meth:`aread`), with a pause for the event loop after each: a scan of
        a whole long stream never holds the loop for more than one read. Raises :class:`OffsetGone`
        when retention deleted the data it was at meanwhile, ``LogClosed`` when the stream went."""
        end = self.visible_end(s, committed)
        if until is not None and until.pos < end.pos:
            end = until
        if at.pos < s.earliest.pos:
            raise OffsetGone(at, s.earliest)
        marks: list[Position] = []
        last, pos = at, at
        while pos.pos < end.pos:
            try:
                batches = await s.aread_range(pos, 4 << 20, end)
            except OffsetGone:
                raise OffsetGone(pos, s.earliest) from None  # retention deleted what the scan was reading
            if not batches:
                break
            for b in batches:
                if max_records is not None and b.end.offset - at.offset > max_records and pos != at:
                    return marks, pos
                pos = b.end
                if pos.offset - last.offset >= every and pos.pos < end.pos:
                    marks.append(pos)
                    last = pos
            await asyncio.sleep(0)
            if s.deleted:  # as a read of it that waited for the store (the caller answers as for no stream)
                raise LogClosed(s.log.directory)
            if pos.pos < end.pos and pos.pos < s.earliest.pos:
                raise OffsetGone(pos, s.earliest)  # retention deleted what the scan was to read next
        return marks, pos

    async def position_at_time(self, s: StreamState, time_ms: int, *, step: int = 1 << 20) -> Position:
        """Where the first batch of ``s`` appended at or after ``time_ms`` (milliseconds since the
        epoch) starts, by the append time every batch header keeps; the durable tail (as it was when
        the lookup began) when none was. Append times are the server's wall clock: if that clock ever
        went back, the first batch stamped at or after ``time_ms`` in log order is found, even if an
        earlier one was stamped later: exactly what a scan from the earliest offset kept would find.

        Not a scan: every log whose data ``s`` shows (a fork's source's, up to the fork point) keeps
        a time index (:meth:`~onceflow.storage.log.StreamLog.find_time`). The lookup first extends
        the indexes it needs to where it needs them, reading the batch headers not indexed yet in
        steps of about ``step`` bytes with a pause for the event loop after each (each byte of a log
        is indexed once while the server runs, and forks of one source share its index); then,
        without a pause, reads one piece of at most ``TIME_INDEX_BYTES`` per log. It begins with a
        pause too, so a caller that looks up many streams lets other requests in between two.

        Retention may delete segments while it pauses: what is left is searched, from the earliest
        offset kept then. Raises :class:`InvalidPosition` when the stream was deleted meanwhile."""
        await asyncio.sleep(0)
        end = s.tail
        while True:
            if s.deleted:
                raise InvalidPosition(f"stream {s.name!r} was deleted")
            view = self._time_view(s, end)
            behind = next(((lg, until) for lg, until in view if not lg.times_indexed(until)), None)
            if behind is None:
                break
            behind[0].index_times(behind[1], step)
            await asyncio.sleep(0)
        for lg, until in view:  # no pause since the check above: the indexes still reach until
            at = lg.find_time(time_ms, until)
            if at is not None:
                return at
        return end

    @staticmethod
    def _time_view(s: StreamState, end: Position) -> Sequence[tuple[StreamLog, Position]]:
        """The logs whose batches ``s`` shows from its earliest offset to ``end``, in log order, each
        with where that view of it ends: a fork whose own log kept its start shows its source's
        log up to the fork point, as :attr:`StreamState.earliest` and ``read_range`` have it."""
        view = [(s.log, end)]
        while s.parent is not None and s.log.first == s.log.base:
            if s.log.base.pos < end.pos:
                end = s.log.base
            s = s.parent
            view.append((s.log, end))
        view.reverse()
        return view

    async def wait(self, s: StreamState, after: Position, max_wait: float) -> bool:
        """Wait until the stream has data past ``after``, closes or goes away. False on timeout."""
        if s.tail != after or s.closed or s.deleted or s.meta.soft_deleted or self._closing:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        s.waiters[fut] = None
        try:
            await asyncio.wait_for(fut, max_wait)
            return True
        except TimeoutError:
            return False
        finally:
            s.waiters.pop(fut, None)


def _read_result(
    s: StreamState, at: Position, end: Position, batches: list[ReadBatch], committed: bool, max_records: int | None
) -> ReadResult:
    """The answer of a read from ``at`` to ``end`` that got ``batches`` (:meth:`Broker.read`)."""
    if max_records is not None:
        for i, b in enumerate(batches):
            if i > 0 and b.end.offset - at.offset > max_records:
                batches = batches[:i]
                break
    nxt = batches[-1].end if batches else at
    if committed:
        batches = [b for b in batches if not s.is_aborted(b)]
    up_to_date = nxt.pos >= end.pos
    return ReadResult(batches, nxt, up_to_date, up_to_date and s.closed and end == s.tail)


def _not_a_boundary(s: StreamState, at: Position, exc: CorruptBatch) -> InvalidPosition:
    log.warning("read of %r at %s: %s", s.name, at.token(), exc)
    return InvalidPosition(f"offset {at.token()} is not a record boundary of this stream")


def txn_outcome(exc: TxnError) -> Outcome:
    """The outcome for a refused transactional request: the coordinator's refusal as it is."""
    return Outcome(exc.refusal, epoch=exc.extra.get("epoch"), txn=exc.extra.get("txn"), detail=str(exc))


def _parse_rfc3339(text: str) -> float | None:
    if not re.match(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$", text):
        return None
    try:
        dt = datetime.fromisoformat(text.replace("z", "Z").replace("t", "T"))
    except ValueError:
        return None
    return dt.timestamp()
