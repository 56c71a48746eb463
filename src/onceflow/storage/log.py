"""A stream's segmented, append-only, crash-safe log.

Write path (group commit)
    1. ``stage()`` runs on the event loop: it frames a batch at the *pending* tail, moves the pending
       tail and the pending producer state, and queues the bytes in the open group. Nothing awaits
       between a caller's validation and its ``stage()``, so staging is serialised per stream.
    2. One flusher task per log writes the whole group with ``pwrite`` and syncs it once (policy
       ``always``) in a worker thread, while the loop keeps staging the next group.
    3. Only then is the group *durable*: the durable tail and producer state advance, waiters are
       released and listeners (live readers) are told. Readers never see past the durable tail.
    4. If the write or sync fails, everything pending is rolled back to the durable state and every
       waiting append fails; a retry of the same producer sequence is then accepted afresh, or, if
       the bytes did reach the disk after all, recognised as a duplicate after recovery.

I/O events
    Each written group (its batches, bytes and the ``fdatasync`` time), each timed sync and each
    failure of the write path is told to the :class:`IoEvents` the log was opened with (one per
    broker, shared by its logs). The storage layer knows no metrics: the server's ``/metrics`` is
    one observer.

Recovery
    Scan from the last producer-state snapshot (or from the start), verify every batch's checksum
    and offsets, truncate the log at the first torn or corrupt batch (dropping later segments), and
    rebuild the tail and producer state from the batch headers. Recovery run twice gives the same
    state, because the first run leaves only intact batches behind.

Reads
    A read runs on the event loop: it decides which segments and byte ranges to read, below the
    durable tail as it is when the read begins (bytes that never change while the log is open), and
    parses the batches. :meth:`StreamLog.aread` (a client's read) awaits a file that may wait for
    its bytes (the PostgreSQL store's, for bytes older than its memory cache), and other tasks run
    meanwhile; after each wait it checks that the segment is still the log's (retention or a delete
    may have removed it: then the read fails as one begun afterwards would). :meth:`StreamLog.read`
    reads blocking, for callers that are not a client's read.

Time index
    Each segment may hold an index of its batches' append times, in memory, built on demand by a
    lookup by time (the broker's, for a group reset by time), never by the write path: ``index_times``
    extends it by one read of the batch headers at a time (each byte of the log is indexed once,
    the caller pauses for the loop in between), ``find_time`` then reads one piece of about
    :data:`TIME_INDEX_BYTES` bytes. See :class:`_Times`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import json
import logging
import time
from array import array
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import crc32c

from ..errors import OnceflowError
from .batch import (
    FLAG_CLOSE,
    FLAG_COMMIT,
    FLAG_CONTROL,
    FLAG_TXN,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    BatchHeader,
    CorruptBatch,
    encode_batch,
    parse_header,
)
from .fs import File, FileSystem, OsFileSystem
from .position import Position

__all__ = [
    "FsyncPolicy",
    "InvalidPosition",
    "IoEvents",
    "IoObserver",
    "LogClosed",
    "OffsetGone",
    "ProducerState",
    "ReadBatch",
    "RecentBatch",
    "Staged",
    "StreamLog",
    "TailState",
    "TxnIndex",
]

log = logging.getLogger("onceflow.storage")

FsyncPolicy = Literal["always", "interval", "never"]

SEGMENT_SUFFIX = ".seg"
SNAPSHOT_NAME = "producers.snap"
RECENT_BATCHES = 5  # per producer, to answer duplicates with the original offsets
DEFAULT_SEGMENT_BYTES = 64 << 20
# A read's steps (StreamLog._reading, _checking): each yields what it needs next, (segment, n, at):
# n bytes at byte ``at`` of that segment's file, is sent them, and returns its result at the end. The
# same steps run blocking (_blocking: the file's pread) or awaited (StreamLog._awaiting).
_R = TypeVar("_R")
_Steps = Generator[tuple["_Segment", int, int], bytes, _R]
# Producer state is snapshotted every this many bytes of log, bounding a crash recovery's scan.
DEFAULT_SNAPSHOT_BYTES = 8 << 20
# The time index has an entry (16 bytes) per piece of about this many bytes of a segment, and a
# lookup by time reads one piece: what it reads and what the index holds stay small together.
TIME_INDEX_BYTES = 64 << 10


class InvalidPosition(OnceflowError):
    """A read was asked to start somewhere that is not a batch boundary of this log."""


class OffsetGone(InvalidPosition):
    """A read was asked for data that retention deleted; ``earliest``: the first position kept."""

    def __init__(self, at: Position, earliest: Position) -> None:
        super().__init__(
            f"offset {at.token()} is no longer kept: retention deleted the data before {earliest.token()}, "
            "the earliest offset this stream still has"
        )
        self.at = at
        self.earliest = earliest


class LogClosed(OnceflowError, OSError):
    """The log's files were released while a read waited for their bytes: its stream was deleted
    (a read begun after the delete finds no stream), or the server is stopping. Nothing was read;
    an ``OSError`` (``ENOENT``)."""

    retriable = True

    def __init__(self, directory: Path) -> None:
        message = f"{directory}: the log was closed while a read waited for its bytes"
        super().__init__(message, code="log_closed")
        self.errno = errno.ENOENT
        self.strerror = message


class IoObserver(Protocol):
    """What an observer of the logs' I/O is told (on the event loop; keep it cheap)."""

    def written(self, batches: int, nbytes: int, sync_seconds: float | None) -> None:
        """A group of ``batches`` batches, ``nbytes`` bytes, was written; ``sync_seconds``: how long
        its ``fdatasync`` took (None when the policy did not sync it)."""

    def synced(self, seconds: float) -> None:
        """A sync of what was written before (policy ``interval``) took ``seconds``."""

    def failed(self, op: str) -> None:
        """A write path I/O call failed: ``op`` is ``write`` (a group's write or sync), ``sync``
        (an interval sync), ``roll`` (a new segment), ``snapshot`` or ``create`` (a new log's first
        batches)."""


class IoEvents:
    """Tells the observers added to it what the logs opened with it write, sync and fail."""

    __slots__ = ("observers",)

    def __init__(self) -> None:
        self.observers: list[IoObserver] = []

    def add(self, observer: IoObserver) -> None:
        self.observers.append(observer)

    def remove(self, observer: IoObserver) -> None:
        with contextlib.suppress(ValueError):
            self.observers.remove(observer)

    # An observer that raises must not reach the write path (a group would be left half
    # committed, its appends waiting forever): its error is logged and the write goes on.

    def written(self, batches: int, nbytes: int, sync_seconds: float | None) -> None:
        for o in self.observers:
            try:
                o.written(batches, nbytes, sync_seconds)
            except Exception:  # noqa: BLE001 - see above
                log.exception("an I/O observer failed; the write goes on")

    def synced(self, seconds: float) -> None:
        for o in self.observers:
            try:
                o.synced(seconds)
            except Exception:  # noqa: BLE001 - see above
                log.exception("an I/O observer failed; the write goes on")

    def failed(self, op: str) -> None:
        for o in self.observers:
            try:
                o.failed(op)
            except Exception:  # noqa: BLE001 - see above
                log.exception("an I/O observer failed; the write goes on")


@dataclass(frozen=True, slots=True)
class RecentBatch:
    first_seq: int
    last_seq: int
    start: Position
    end: Position


@dataclass(frozen=True, slots=True)
class ProducerState:
    """What the log says about one idempotent producer: its epoch and last accepted sequence."""

    epoch: int
    last_seq: int
    recent: tuple[RecentBatch, ...] = ()

    def after(self, epoch: int, first_seq: int, last_seq: int, start: Position, end: Position) -> ProducerState:
        recent = self.recent if epoch == self.epoch else ()
        entry = RecentBatch(first_seq, last_seq, start, end)
        return ProducerState(epoch, last_seq, (*recent[-(RECENT_BATCHES - 1) :], entry))

    def find(self, seq: int) -> RecentBatch | None:
        for entry in self.recent:
            if entry.first_seq <= seq <= entry.last_seq:
                return entry
        return None


def _advance(
    prev: ProducerState | None, epoch: int, first: int, last: int, start: Position, end: Position
) -> ProducerState:
    base = prev if prev is not None else ProducerState(epoch, -1)
    return base.after(epoch, first, last, start, end)


@dataclass(frozen=True, slots=True)
class TailState:
    """The end of the log and the stream state that only ever changes at the end.

    ``end`` is where the next batch goes. ``final`` is set once the stream is closed: the end of its
    data when it closed, which is where clients see the stream end (``client_end``). A close without
    data is a zero-record batch whose bytes lie past ``final``: the close is durable and atomic like
    any batch, yet takes no offset space as clients see it (Durable Streams PROTOCOL.md 5.3: a close
    leaves the tail unchanged). Batches written after the close (transaction markers) do not move it.
    """

    end: Position
    closed: bool = False
    closed_by: tuple[str, int, int] | None = None  # (producer id, epoch, seq) that closed it
    stream_seq: bytes | None = None  # the last Stream-Seq appended
    final: Position | None = None  # the end of the data at the close (None while open)

    @property
    def client_end(self) -> Position:
        """The tail as clients see it: ``final`` once closed, else ``end``."""
        return self.final if self.final is not None else self.end

    def after(self, h: BatchHeader, start: Position, end: Position) -> TailState:
        """The state after batch ``h``, which spans ``[start, end)``."""
        return self.staged(
            flags=h.flags,
            count=h.count,
            producer_id=h.producer_id,
            epoch=h.epoch,
            last_seq=h.last_seq,
            stream_seq=h.stream_seq,
            start=start,
            end=end,
        )

    def staged(
        self,
        *,
        flags: int,
        count: int,
        producer_id: str | None,
        epoch: int,
        last_seq: int,
        stream_seq: bytes | None,
        start: Position,
        end: Position,
    ) -> TailState:
        """The state after a batch with these header fields, spanning ``[start, end)``."""
        closes = bool(flags & FLAG_CLOSE)
        final = self.final
        if closes and not self.closed:
            final = end if count else start  # a close-only batch ends nothing a client can see
        return TailState(
            end=end,
            closed=self.closed or closes,
            closed_by=(producer_id, epoch, last_seq) if closes and producer_id is not None else self.closed_by,
            stream_seq=stream_seq if stream_seq is not None else self.stream_seq,
            final=final,
        )


@dataclass(slots=True)
class TxnIndex:
    """Transactions as this stream's log records them.

    ``open``: where each producer's transaction that has data here but no marker yet began; the
    earliest of them is the last stable offset (LSO): read_committed readers stop there.
    ``aborted``: per producer, the byte ranges ``[first batch, abort marker)`` of aborted transactions;
    read_committed readers skip that producer's batches inside them.
    ``ended``: per producer, the latest ``(epoch, transaction number)`` its markers here named (the
    number rides in the marker's sequence fields; -1 when the writer did not know it). The
    coordinator's recovery uses it to tell whether a logged decision already reached this stream.
    ``committed``: the same for its *commit* markers; recovery uses it to learn
    of a one-stream transaction committed by its marker alone (``Transaction-Commit``).
    Rebuilt from the log on recovery.
    """

    open: dict[str, Position] = field(default_factory=dict)
    aborted: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    ended: dict[str, tuple[int, int]] = field(default_factory=dict)
    committed: dict[str, tuple[int, int]] = field(default_factory=dict)

    def apply(self, flags: int, producer_id: str | None, start: Position, epoch: int = -1, txn: int = -1) -> None:
        if producer_id is None:
            return
        if flags & FLAG_CONTROL:
            began = self.open.pop(producer_id, None)
            if began is not None and not flags & FLAG_COMMIT:
                self.aborted.setdefault(producer_id, []).append((began.pos, start.pos))
            # the latest one named, not the last written: recovery may rewrite an earlier
            # transaction's marker after a later one's (harmless when nothing is open)
            self.ended[producer_id] = max((epoch, txn), self.ended.get(producer_id, (epoch, txn)))
            if flags & FLAG_COMMIT:
                self.committed[producer_id] = max((epoch, txn), self.committed.get(producer_id, (epoch, txn)))
        elif flags & FLAG_TXN and producer_id not in self.open:
            self.open[producer_id] = start

    def stable(self, end: Position) -> Position:
        """The last stable offset given the log's end."""
        return min(self.open.values(), key=lambda p: p.pos, default=end)

    def is_aborted(self, producer_id: str | None, pos: int) -> bool:
        if producer_id is None:
            return False
        return any(a <= pos < b for a, b in self.aborted.get(producer_id, ()))

    def to_json(self) -> dict[str, Any]:
        return {
            "open": {pid: [p.offset, p.pos] for pid, p in self.open.items()},
            "aborted": {pid: [list(r) for r in ranges] for pid, ranges in self.aborted.items()},
            "ended": {pid: list(e) for pid, e in self.ended.items()},
            "committed": {pid: list(e) for pid, e in self.committed.items()},
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> TxnIndex:
        if not raw:
            return cls()
        return cls(
            open={pid: Position(*p) for pid, p in raw["open"].items()},
            aborted={pid: [(a, b) for a, b in ranges] for pid, ranges in raw["aborted"].items()},
            ended={pid: (e[0], e[1]) for pid, e in raw.get("ended", {}).items()},
            committed={pid: (e[0], e[1]) for pid, e in raw.get("committed", {}).items()},
        )


@dataclass(slots=True)
class ReadBatch:
    """A durable batch as read back: its header, its payload bytes and where it starts and ends."""

    header: BatchHeader
    payload: bytes
    start: Position
    end: Position


@dataclass(slots=True)
class Staged:
    """A batch accepted into the pending tail; ``done`` resolves once it is durable."""

    start: Position
    end: Position
    done: asyncio.Future[None]


@dataclass(slots=True)
class _Group:
    gid: int
    chunks: list[bytes] = field(default_factory=list)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    producers: list[tuple[str, ProducerState]] = field(default_factory=list)
    txn_events: list[tuple[int, str | None, Position, int, int]] = field(default_factory=list)
    tail: TailState | None = None


class _Times:
    """The time index of one segment: where each of its pieces starts (bytes into the segment) and
    the latest append time of any batch from the segment's start to that piece's end.

    The latest so far, not each piece's own: append times are the server's wall clock, which can
    step back, so they are not in order, but their running maximum is. The first piece whose
    running maximum reaches a time T therefore holds the first batch, in log order, appended at or
    after T (Kafka's time index keeps the same maximum for the same reason), and a binary search
    finds that piece. A piece begins with the first batch that starts ``time_index_bytes`` (the
    log's, :data:`TIME_INDEX_BYTES`) or more past the previous piece's start, so every batch header
    of a piece lies within that many bytes (plus one header) of its start: one read holds them all.

    The index covers the segment's first ``done`` bytes (a batch boundary, whose record offset is
    ``next_offset``); it only grows, as the segment's data never changes once durable."""

    __slots__ = ("done", "highs", "next_offset", "starts")

    def __init__(self, offset: int) -> None:
        self.starts = array("q")
        self.highs = array("q")
        self.done = 0
        self.next_offset = offset


@dataclass(slots=True)
class _Segment:
    base: Position
    path: Path
    file: File
    size: int
    first_ms: int | None = None  # the append time of its first batch, once read (retention by age)
    times: _Times | None = None  # its time index, once a lookup by time needed it


def _segment_name(base: Position) -> str:
    return f"{base.pos:020d}-{base.offset:020d}{SEGMENT_SUFFIX}"


def _parse_segment_name(name: str) -> Position | None:
    stem = name[: -len(SEGMENT_SUFFIX)]
    parts = stem.split("-")
    if not name.endswith(SEGMENT_SUFFIX) or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return Position(int(parts[1]), int(parts[0]))


_OS = OsFileSystem()  # for logs opened without a file system of their own (tests, tools)


def _write_all(f: File, data: bytes, at: int, sync: bool) -> float | None:
    """Write ``data`` at ``at`` and, with ``sync``, fdatasync it; how long the sync took."""
    f.pwrite(data, at)
    if not sync:
        return None
    began = time.perf_counter()
    f.sync()
    return time.perf_counter() - began


def _timed_sync(f: File) -> float:
    began = time.perf_counter()
    f.sync()
    return time.perf_counter() - began


class StreamLog:
    """The log of one stream. Create with :meth:`open`; every method runs on the event loop."""

    def __init__(
        self,
        directory: Path,
        *,
        policy: FsyncPolicy = "always",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        executor: Executor | None = None,
        snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
        fs: FileSystem | None = None,
        clock: Callable[[], float] | None = None,
        io: IoEvents | None = None,
    ) -> None:
        self.directory = directory
        self.fs: FileSystem = fs or _OS
        self.io = io  # told of writes, syncs and failures (see IoEvents)
        self._clock = clock  # wall-clock seconds for batch timestamps (None: the system's)
        self.snapshot_bytes = snapshot_bytes
        self.time_index_bytes = TIME_INDEX_BYTES  # see _Times (the tests make pieces small)
        self.policy: FsyncPolicy = policy
        self.segment_bytes = segment_bytes
        self._executor = executor
        self._segments: list[_Segment] = []
        self.base = Position(0, 0)
        self.durable = TailState(self.base)
        self.pending = self.durable
        self.producers: dict[str, ProducerState] = {}
        self.txn = TxnIndex()  # durable transaction index (see TxnIndex)
        self._overlay: dict[str, tuple[int, ProducerState]] = {}
        self._group: _Group | None = None
        self._next_gid = 0
        self._flusher: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[], None]] = []
        self._dirty = False  # written but not yet synced (interval / never policies)
        self._snapshot_pos = 0  # log position of the last snapshot written
        self.closed_for_writes = False

    # ------------------------------------------------------------------ recovery

    @classmethod
    def open(
        cls,
        directory: Path,
        base: Position,
        *,
        policy: FsyncPolicy = "always",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        executor: Executor | None = None,
        use_snapshot: bool = True,
        snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
        fs: FileSystem | None = None,
        clock: Callable[[], float] | None = None,
        io: IoEvents | None = None,
    ) -> StreamLog:
        """Open (creating if needed) the log in ``directory`` whose first batch starts at ``base``."""
        self = cls(
            directory,
            policy=policy,
            segment_bytes=segment_bytes,
            executor=executor,
            snapshot_bytes=snapshot_bytes,
            fs=fs,
            clock=clock,
            io=io,
        )
        self.base = base
        fs = self.fs
        if not fs.exists(directory):
            fs.mkdir(directory)
            fs.sync_dir(directory.parent)  # the log's own name must survive a power loss too
        found = sorted(
            (p for p in (_parse_segment_name(name) for name in fs.listdir(directory)) if p is not None),
            key=lambda p: p.pos,
        )
        if not found:
            self._add_segment(base)
            self.durable = self.pending = TailState(base)
            return self
        for seg_base in found:
            path = directory / _segment_name(seg_base)
            f = fs.open_file(path, create=False)
            self._segments.append(_Segment(seg_base, path, f, f.size()))
        self._recover(use_snapshot)
        return self

    def _load_snapshot(self) -> tuple[TailState, dict[str, ProducerState], TxnIndex] | None:
        path = self.directory / SNAPSHOT_NAME
        try:
            raw = json.loads(self.fs.read_bytes(path))
            if raw["closed"] and "final" not in raw:
                return None  # written before closing kept the tail: scan the log once instead
            tail = TailState(
                end=Position(*raw["end"]),
                closed=raw["closed"],
                closed_by=(raw["closed_by"][0], raw["closed_by"][1], raw["closed_by"][2]) if raw["closed_by"] else None,
                stream_seq=bytes.fromhex(raw["stream_seq"]) if raw["stream_seq"] is not None else None,
                final=Position(*raw["final"]) if raw.get("final") is not None else None,
            )
            producers = {
                pid: ProducerState(
                    p["epoch"],
                    p["last_seq"],
                    tuple(RecentBatch(r[0], r[1], Position(*r[2]), Position(*r[3])) for r in p["recent"]),
                )
                for pid, p in raw["producers"].items()
            }
            txn = TxnIndex.from_json(raw.get("txn"))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable snapshot %s: %s", path, exc)
            return None
        return tail, producers, txn

    def _write_snapshot(self) -> None:
        """Persist the durable tail and producer state so the next recovery scans less."""
        tail = self.durable
        raw = {
            "end": [tail.end.offset, tail.end.pos],
            "closed": tail.closed,
            "closed_by": list(tail.closed_by) if tail.closed_by else None,
            "stream_seq": tail.stream_seq.hex() if tail.stream_seq is not None else None,
            "final": [tail.final.offset, tail.final.pos] if tail.final is not None else None,
            "txn": self.txn.to_json(),
            "producers": {
                pid: {
                    "epoch": p.epoch,
                    "last_seq": p.last_seq,
                    "recent": [
                        [r.first_seq, r.last_seq, [r.start.offset, r.start.pos], [r.end.offset, r.end.pos]]
                        for r in p.recent
                    ],
                }
                for pid, p in self.producers.items()
            },
        }
        self.fs.replace_file(self.directory / SNAPSHOT_NAME, json.dumps(raw).encode(), sync_dir=False)
        self._snapshot_pos = tail.end.pos

    def _recover(self, use_snapshot: bool) -> None:
        segs = self._segments
        # Segments must tile the log: each starts where the previous one ends. A gap means
        # later segments cannot be trusted; they are dropped after scanning decides the end.
        start_index = 0
        tail = TailState(segs[0].base)
        producers: dict[str, ProducerState] = {}
        snap = self._load_snapshot() if use_snapshot else None
        used = False
        self.txn = TxnIndex()
        if snap is not None:
            s_tail, s_producers, s_txn = snap
            i = self._segment_index(s_tail.end.pos)
            seg = segs[i]
            if seg.base.pos <= s_tail.end.pos <= seg.base.pos + seg.size:
                start_index, tail, producers, used = i, s_tail, s_producers, True
                self.txn = s_txn
        if not used and use_snapshot and segs[0].base != self.base:
            # retention deleted the start of this log: what producers, the stream's closing and its
            # transactions' markers wrote there lived on only in the snapshot, which is missing or
            # does not fit, so a retry of an append whose data was deleted is no longer recognised
            log.error(
                "%s: the producer snapshot is missing or unusable and retention deleted the log's start "
                "(before %s): producers, Stream-Seq and transaction markers seen only there are forgotten",
                self.directory,
                segs[0].base.token(),
            )
        tail, producers = self._scan(start_index, tail, producers)
        self.durable = self.pending = tail
        self.producers = producers
        # A snapshot that recovery did not use (or that describes more than the log now holds) must
        # never be trusted later, once the log has grown past it again: replace it with the state
        # just recovered, after making that state's bytes durable.
        if not used or snap is None or snap[0] != tail:
            self._segments[-1].file.sync()
            self._write_snapshot()
        self._snapshot_pos = tail.end.pos

    def _scan(
        self, index: int, tail: TailState, producers: dict[str, ProducerState]
    ) -> tuple[TailState, dict[str, ProducerState]]:
        """Verify and replay the log from ``tail`` (inside segment ``index``) to its end.

        Hot loop: most batches only move the offsets; objects are built only for batches that
        change producer or stream state, and producer history is kept as plain tuples until the end.
        """
        segs = self._segments
        unpack = HEADER.unpack_from
        checksum = crc32c.crc32c
        # producer id -> [epoch, last_seq, recent (first, last, start_off, start_pos, end_off, end_pos)]
        seen: dict[str, list[Any]] = {}
        offset = tail.end.offset
        i = index
        try:
            while i < len(segs):
                seg = segs[i]
                if i != index and seg.base != tail.end:  # segments must tile the log
                    log.warning("segment %s does not start at the log end; dropping it and later ones", seg.path)
                    self._drop_segments_from(i)
                    break
                rel = (tail.end.pos - seg.base.pos) if i == index else 0
                base_pos = seg.base.pos + rel
                data = seg.file.pread(seg.size - rel, rel) if seg.size > rel else b""
                view = memoryview(data)
                n = len(data)
                p = 0
                while p < n:
                    bad = ""
                    if n - p < HEADER_SIZE:
                        bad = "truncated header"
                    else:
                        crc, length, magic, flags, _r, base, count, _ts, epoch, fseq, lseq, pid_len, sseq_len = unpack(
                            data, p
                        )
                        if magic != MAGIC:
                            bad = f"bad magic {magic:#x}"
                        elif length < HEADER_SIZE + pid_len + sseq_len or length > n - p:
                            bad = f"torn batch (length {length}, {n - p} bytes left)"
                        elif base != offset or count < 0:
                            bad = f"base offset {base}, expected {offset}"
                        elif checksum(view[p + 4 : p + length]) != crc:
                            bad = "checksum mismatch"
                    if bad:
                        log.warning("%s: truncating at byte %d: %s", seg.path, rel + p, bad)
                        seg.file.truncate(rel + p)
                        seg.file.sync()
                        seg.size = rel + p
                        tail = replace(tail, end=Position(offset, base_pos + p))
                        self._drop_segments_from(i + 1)
                        return tail, producers
                    if (pid_len or epoch >= 0) and not flags & FLAG_CONTROL:  # markers do not move sequences
                        pid = bytes(view[p + HEADER_SIZE : p + HEADER_SIZE + pid_len]).decode("utf-8", "replace")
                        entry = (fseq, lseq, offset, base_pos + p, offset + count, base_pos + p + length)
                        st = seen.get(pid)
                        if st is None:
                            prev = producers.get(pid)
                            st = seen[pid] = [-1, -1, deque((), RECENT_BATCHES)]
                            if prev is not None:
                                st[0], st[1] = prev.epoch, prev.last_seq
                                st[2].extend(
                                    (r.first_seq, r.last_seq, r.start.offset, r.start.pos, r.end.offset, r.end.pos)
                                    for r in prev.recent
                                )
                        if epoch != st[0]:
                            st[2].clear()
                        st[0], st[1] = epoch, lseq
                        st[2].append(entry)
                    if flags & (FLAG_TXN | FLAG_CONTROL):
                        txn_pid = (
                            bytes(view[p + HEADER_SIZE : p + HEADER_SIZE + pid_len]).decode("utf-8", "replace")
                            if pid_len or epoch >= 0
                            else None
                        )
                        self.txn.apply(flags, txn_pid, Position(offset, base_pos + p), epoch, fseq)
                    if flags & FLAG_CLOSE or sseq_len:
                        h = parse_header(data, p, verify=False)
                        tail = tail.after(
                            h, Position(offset, base_pos + p), Position(offset + count, base_pos + p + length)
                        )
                    offset += count
                    p += length
                tail = replace(tail, end=Position(offset, base_pos + p))
                i += 1
            return tail, producers
        finally:
            for pid, (epoch, last_seq, recent) in seen.items():
                producers[pid] = ProducerState(
                    epoch,
                    last_seq,
                    tuple(RecentBatch(f, lq, Position(so, sp), Position(eo, ep)) for f, lq, so, sp, eo, ep in recent),
                )

    def _drop_segments_from(self, i: int) -> None:
        for seg in self._segments[i:]:
            seg.file.close()
            self.fs.unlink(seg.path)
        del self._segments[i:]
        self.fs.sync_dir(self.directory)

    def _add_segment(self, base: Position) -> None:
        path = self.directory / _segment_name(base)
        f = self.fs.open_file(path, create=True)
        self._segments.append(_Segment(base, path, f, f.size()))
        self.fs.sync_dir(self.directory)

    def _segment_index(self, pos: int) -> int:
        bases = [s.base.pos for s in self._segments]
        return max(0, bisect.bisect_right(bases, pos) - 1)

    # ------------------------------------------------------------------ retention

    @property
    def first(self) -> Position:
        """The first position this log still holds: ``base`` until retention deleted segments."""
        return self._segments[0].base if self._segments else self.base

    def _first_ms(self, seg: _Segment) -> int | None:
        if seg.first_ms is None and seg.size >= HEADER_SIZE:
            # on the loop, once per segment: on the PostgreSQL store one query, bounded by its
            # read_timeout (storage/pgfs.py); the sweep pauses between streams (core/broker.py)
            seg.first_ms = HEADER.unpack(seg.file.pread(HEADER_SIZE, 0))[7]
        return seg.first_ms

    def deletable(self, *, now_ms: int, max_age_ms: int | None, max_bytes: int | None, keep_from: Position) -> int:
        """How many of the oldest segments retention may delete: each one whole, never the one
        being written, none that ends past ``keep_from`` (what the caller must keep: open
        transactions, groups' offsets). A segment goes when everything in it is older than
        ``max_age_ms`` (the next segment's first batch, appended after all of it, is) or while
        the log without it still holds ``max_bytes``."""
        segs = self._segments
        total = sum(seg.size for seg in segs)
        n = 0
        while n < len(segs) - 1:
            seg, after = segs[n], segs[n + 1]
            if after.base.pos > keep_from.pos or after.base.pos > self.durable.end.pos:
                break
            by_size = max_bytes is not None and total - seg.size >= max_bytes
            if not by_size:
                ts = self._first_ms(after) if max_age_ms is not None else None
                if ts is None or max_age_ms is None or ts > now_ms - max_age_ms:
                    break
            total -= seg.size
            n += 1
        return n

    async def delete_oldest(self, n: int, *, recheck: Callable[[], int] | None = None) -> int:
        """Delete the ``n`` oldest segments (see :meth:`deletable`); returns their bytes.

        What the producers and the transaction index learned from them lives on in the snapshot,
        which every roll writes at the new segment's start: it must lie past what goes, and its
        name is synced before any segment file is unlinked, so a power loss cannot leave a log
        whose only snapshot describes deleted data. Segments go oldest first, so a crash in
        between leaves a log that still tiles from its (new) first segment.

        Whatever happens while that sync runs counts: ``recheck`` (the caller's :meth:`deletable`)
        is asked again afterwards, and at most that many go (a fork may have been made of the data,
        a group's offset moved back). The decision and the deletion then run on the loop without a
        pause, and only in a log still open: a stream deleted meanwhile may already have been
        created again, in the same directory, with the same first segment name (unlinking that by
        name from a worker thread once deleted the new stream's data)."""
        n = min(n, len(self._segments) - 1)
        if n <= 0:
            return 0
        if self._snapshot_pos < self._segments[n].base.pos:
            log.warning("%s: not deleting old segments yet: the last snapshot lies before them", self.directory)
            return 0
        gone = self._segments[:n]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.fs.sync_dir, self.directory)  # the snapshot's name first
        if self.closed_for_writes or list(map(id, self._segments[:n])) != list(map(id, gone)):
            return 0
        if recheck is not None:
            n = min(n, recheck())
            if n <= 0:
                return 0
            gone = gone[:n]
        del self._segments[:n]  # in place: a roll may be appending in a worker thread; reads see the new start at once
        for seg in gone:
            seg.file.close()
            # on the loop (by name, see above): on the PostgreSQL store a write the loop waits for at
            # most the store's write_timeout (storage/pgfs.py: past it, its outcome is unknown)
            self.fs.unlink(seg.path)
        await loop.run_in_executor(self._executor, self.fs.sync_dir, self.directory)
        return sum(seg.size for seg in gone)

    # ------------------------------------------------------------------ state views

    def producer(self, producer_id: str) -> ProducerState | None:
        """The producer's state including staged, not yet durable batches."""
        over = self._overlay.get(producer_id)
        if over is not None:
            return over[1]
        return self.producers.get(producer_id)

    def durable_producer(self, producer_id: str) -> ProducerState | None:
        return self.producers.get(producer_id)

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the loop) each time the durable tail moves."""
        self._listeners.append(fn)

    def tell_listeners(self) -> None:
        """Call the listeners although this log did not change: what it shows did (a fork, when
        the last stable offset of the stream it forked moves)."""
        for fn in list(self._listeners):
            fn()

    # ------------------------------------------------------------------ writes

    def write_initial(self, batches: list[tuple[bytes, int, int]]) -> None:
        """Write ``(payload, count, flags)`` batches to a new log and sync them, blocking.

        Used while creating a stream, before its metadata makes it visible.
        """
        seg = self._segments[-1]
        try:
            for payload, count, flags in batches:
                start = self.durable.end
                data = encode_batch(
                    base_offset=start.offset, count=count, payload=payload, flags=flags, timestamp=self._now_ms()
                )
                seg.file.pwrite(data, start.pos - seg.base.pos)
                seg.size += len(data)
                end = Position(start.offset + count, start.pos + len(data))
                self.durable = self.durable.after(parse_header(data, 0), start, end)
            seg.file.sync()
        except OSError:
            if self.io is not None:
                self.io.failed("create")
            raise
        self.pending = self.durable

    def _now_ms(self) -> int | None:
        return int(self._clock() * 1000) if self._clock is not None else None

    def stage(
        self,
        *,
        count: int,
        payload: bytes,
        flags: int = 0,
        producer_id: str | None = None,
        epoch: int = -1,
        first_seq: int = -1,
        last_seq: int = -1,
        stream_seq: bytes | None = None,
    ) -> Staged:
        """Append a batch at the pending tail. The caller has validated it against :meth:`producer`."""
        if self.closed_for_writes:
            raise RuntimeError("log is closed")
        start = self.pending.end
        data = encode_batch(
            base_offset=start.offset,
            count=count,
            payload=payload,
            flags=flags,
            producer_id=producer_id,
            epoch=epoch,
            first_seq=first_seq,
            last_seq=last_seq,
            stream_seq=stream_seq,
            timestamp=self._now_ms(),
        )
        end = Position(start.offset + count, start.pos + len(data))
        if self._group is None:
            self._group = _Group(self._next_gid)
            self._next_gid += 1
        group = self._group
        group.chunks.append(data)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        group.waiters.append(fut)
        self.pending = self.pending.staged(
            flags=flags,
            count=count,
            producer_id=producer_id,
            epoch=epoch,
            last_seq=last_seq,
            stream_seq=stream_seq,
            start=start,
            end=end,
        )
        group.tail = self.pending
        if flags & (FLAG_TXN | FLAG_CONTROL):
            group.txn_events.append((flags, producer_id, start, epoch, first_seq))
        if producer_id is not None and not flags & FLAG_CONTROL:  # markers do not move sequences
            state = _advance(self.producer(producer_id), epoch, first_seq, last_seq, start, end)
            self._overlay[producer_id] = (group.gid, state)
            group.producers.append((producer_id, state))
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        return Staged(start, end, fut)

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._group is not None:
                group, self._group = self._group, None
                if self._released(group):
                    continue
                seg = self._segments[-1]
                # Between groups the durable state is still, so rolls and snapshots see it whole.
                op = "roll"
                try:
                    if seg.size >= self.segment_bytes and seg.base != self.durable.end:
                        await loop.run_in_executor(self._executor, self._roll)
                        if self._released(group):
                            continue
                        seg = self._segments[-1]
                    elif self.durable.end.pos - self._snapshot_pos >= self.snapshot_bytes:
                        op = "snapshot"
                        await loop.run_in_executor(self._executor, self._checkpoint)
                except OSError as exc:  # the group waited for it: it fails like a write would (and may be retried)
                    if self.io is not None:
                        self.io.failed(op)
                    self._rollback(group, exc)
                    continue
                data = b"".join(group.chunks) if len(group.chunks) > 1 else group.chunks[0]
                at = self.durable.end.pos - seg.base.pos
                try:
                    took = await loop.run_in_executor(
                        self._executor, _write_all, seg.file, data, at, self.policy == "always"
                    )
                except OSError as exc:
                    if self.io is not None:
                        self.io.failed("write")
                    self._rollback(group, exc)
                    continue
                seg.size = max(seg.size, at + len(data))
                self._dirty = self.policy != "always"
                if self.io is not None:
                    self.io.written(len(group.chunks), len(data), took)
                self._commit(group)
        finally:
            self._flusher = None

    def _commit(self, group: _Group) -> None:
        assert group.tail is not None
        self.durable = group.tail
        for flags, pid, start, epoch, txn in group.txn_events:
            self.txn.apply(flags, pid, start, epoch, txn)
        for pid, state in group.producers:
            self.producers[pid] = state
            over = self._overlay.get(pid)
            if over is not None and over[0] == group.gid:
                del self._overlay[pid]
        for fut in group.waiters:
            if not fut.done():
                fut.set_result(None)
        for fn in list(self._listeners):
            fn()

    def _released(self, group: _Group) -> bool:
        """Whether :meth:`close_files` released the files after ``group`` was staged (its stream
        was deleted meanwhile). The group then fails as after a failed write: nothing will write it,
        and its appends would otherwise wait for an answer for ever."""
        if self._segments:
            return False
        gone = OSError(errno.ENOENT, "the stream was deleted before the append was written", str(self.directory))
        self._rollback(group, gone)
        return True

    def _rollback(self, group: _Group, exc: OSError) -> None:
        """A write or sync failed: forget everything not durable and fail its waiters."""
        log.error("append to %s failed, rolling back %d pending batch(es): %s", self.directory, len(group.waiters), exc)
        failed = [group]
        if self._group is not None:
            failed.append(self._group)
            self._group = None
        self.pending = self.durable
        self._overlay.clear()
        if self._segments:  # There are none once close_files released them, and nothing to cut back.
            seg = self._segments[-1]
            with contextlib.suppress(OSError):
                seg.file.truncate(self.durable.end.pos - seg.base.pos)
                seg.size = self.durable.end.pos - seg.base.pos
        for g in failed:
            for fut in g.waiters:
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # mark retrieved; the append handler re-raises from its await
        for fn in list(self._listeners):
            fn()  # retries waiting on a rolled-back original must re-check and fail too

    def _roll(self) -> None:
        """Start a new segment at the durable end (in a worker thread, between groups). All or
        nothing: a new segment whose name or snapshot could not be made durable is taken back, so
        no data goes into it and the next group tries the roll again (retention deletes nothing
        the last snapshot does not lie past)."""
        old = self._segments[-1]
        if self.policy != "always":
            old.file.sync()
        try:
            self._add_segment(self.durable.end)
            self._write_snapshot()
        except OSError:
            new = self._segments[-1]
            if new is not old:
                self._segments.pop()
                with contextlib.suppress(OSError):
                    new.file.close()
                    self.fs.unlink(new.path)
            raise
        self._dirty = False

    def _checkpoint(self) -> None:
        """Snapshot the durable state so a crash recovery scans at most ``snapshot_bytes``."""
        if self.policy != "always":
            self._segments[-1].file.sync()
            self._dirty = False
        self._write_snapshot()

    async def sync(self) -> None:
        """Make everything written so far durable (used by the ``interval`` policy)."""
        if not self._dirty:
            return
        self._dirty = False
        f = self._segments[-1].file
        try:
            took = await asyncio.get_running_loop().run_in_executor(self._executor, _timed_sync, f)
        except OSError:
            if self.io is not None:
                self.io.failed("sync")
            raise
        if self.io is not None:
            self.io.synced(took)

    @property
    def idle(self) -> bool:
        """Nothing is staged or being written: the files hold everything this log was given."""
        return self._flusher is None and self._group is None

    async def drain(self) -> None:
        """Wait until nothing is staged or being written."""
        while self._flusher is not None:
            await asyncio.shield(self._flusher)

    async def close(self) -> None:
        """Flush, sync, snapshot and release the files. The log is unusable afterwards."""
        self.closed_for_writes = True
        with contextlib.suppress(OSError):
            await self.drain()
        for fn in list(self._listeners):
            fn()
        self._listeners.clear()
        try:
            if self._segments:
                self._segments[-1].file.sync()
                self._write_snapshot()
        except OSError as exc:
            log.warning("could not snapshot %s on close: %s", self.directory, exc)
        self.close_files()

    def close_files(self) -> None:
        """Release file descriptors without flushing (the log's directory is about to vanish)."""
        self.closed_for_writes = True
        for seg in self._segments:
            with contextlib.suppress(OSError):
                seg.file.close()
        self._segments.clear()

    # ------------------------------------------------------------------ reads

    def check_position(self, at: Position) -> None:
        """Raise InvalidPosition unless ``at`` is a batch boundary of the durable log.

        On the loop, its reads too (a header, then that batch): on the PostgreSQL store, bytes older
        than the memory cache are a query each, bounded by its read_timeout (storage/pgfs.py).
        :meth:`acheck_position` lets other tasks run while they wait for the database."""
        _blocking(self._checking(at))

    async def acheck_position(self, at: Position) -> None:
        """:meth:`check_position` for a client's read: the same checks, its reads as :meth:`aread`
        makes them."""
        await self._awaiting(self._checking(at), at)

    def _checking(self, at: Position) -> _Steps[None]:
        end = self.durable.end
        if at == end:
            return
        if at.pos < self.base.pos or at.pos > end.pos or at.offset > end.offset:
            raise InvalidPosition(f"offset {at.token()} is outside this stream")
        if at.pos < self.first.pos:
            raise OffsetGone(at, self.first)
        self._check_open()
        seg = self._segments[self._segment_index(at.pos)]
        rel = at.pos - seg.base.pos
        raw = yield seg, HEADER_SIZE, rel
        bad = InvalidPosition(f"offset {at.token()} is not a record boundary of this stream")
        if len(raw) < HEADER_SIZE:
            raise bad
        fields = HEADER.unpack(raw)
        length = fields[1]
        if fields[2] != MAGIC or fields[5] != at.offset or not HEADER_SIZE <= length <= end.pos - at.pos:
            raise bad
        try:
            parse_header((yield seg, length, rel), 0, verify=True)
        except CorruptBatch:
            raise bad from None

    def read(self, at: Position, max_bytes: int, limit: Position | None = None) -> list[ReadBatch]:
        """Durable batches from ``at`` on, about ``max_bytes`` of them (at least one if any).

        ``limit`` caps the read at a position (a fork reading its parent). ``at`` must have passed
        :meth:`check_position`; bytes that still do not parse raise CorruptBatch.

        On the loop, about max_bytes (or one larger batch) a call; on the PostgreSQL store a query
        per segment for bytes older than the memory cache, bounded by its read_timeout. A client's
        read uses :meth:`aread`, which lets other tasks run while such a query waits.
        """
        return _blocking(self._reading(at, max_bytes, limit))

    async def aread(self, at: Position, max_bytes: int, limit: Position | None = None) -> list[ReadBatch]:
        """:meth:`read`, the same batches, for a client's read: a file that may wait for its bytes
        (``apread``: the PostgreSQL store's, for bytes older than its memory cache) is awaited, and
        other tasks run meanwhile; a file that reads at once (the local disk's) is read as
        :meth:`read` does, and then nothing is awaited at all.

        The log decides on the loop which segments and ranges to read, below the durable end as it
        is when the read begins (bytes that never change while the log is open), and parses what
        comes back on the loop. After each wait it checks that the segment read is still the log's:
        if retention deleted it meanwhile the read raises :class:`OffsetGone`, as a read begun after
        the deletion would, and if the log's files were released (its stream deleted, the server
        stopping), :class:`LogClosed`; never bytes of a file that went."""
        return await self._awaiting(self._reading(at, max_bytes, limit), at)

    async def _awaiting(self, steps: _Steps[_R], at: Position) -> _R:
        """Run a read's steps (:meth:`_reading`, :meth:`_checking`), each segment's bytes with its
        file's ``apread`` when it has one (see :meth:`aread`)."""
        try:
            need = next(steps)
            while True:
                seg, n, rel = need
                apread = getattr(seg.file, "apread", None)
                if apread is None:
                    data = seg.file.pread(n, rel)
                else:
                    data = await apread(n, rel)
                    self._still_holds(seg, at)
                need = steps.send(data)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            steps.close()

    def _still_holds(self, seg: _Segment, at: Position) -> None:
        """After a read of ``seg`` waited: raise unless ``seg`` is still one of this log's segments
        (retention deletes a segment, and a deleted stream releases them all, before removing its
        file, both on the loop: so a segment still here had its bytes throughout)."""
        segs = self._segments
        if segs:
            i = self._segment_index(seg.base.pos)
            if segs[i] is seg:
                return
            raise OffsetGone(at, self.first)
        self._check_open()

    def _check_open(self) -> None:
        if not self._segments:
            raise LogClosed(self.directory)

    def _reading(self, at: Position, max_bytes: int, limit: Position | None) -> _Steps[list[ReadBatch]]:
        end = self.durable.end
        if limit is not None and limit.pos < end.pos:
            end = limit
        if at.pos < self.first.pos:
            raise OffsetGone(at, self.first)  # a reader that was here before retention deleted it
        out: list[ReadBatch] = []
        pos, offset, budget = at.pos, at.offset, max_bytes
        while pos < end.pos:
            self._check_open()
            seg_i = self._segment_index(pos)
            seg = self._segments[seg_i]
            seg_end = min(seg.base.pos + seg.size, end.pos)
            if seg_i + 1 < len(self._segments):
                seg_end = min(seg_end, self._segments[seg_i + 1].base.pos)
            rel = pos - seg.base.pos
            data = yield seg, min(seg_end - pos, max(budget, HEADER_SIZE)), rel
            p = 0
            while len(data) - p >= HEADER_SIZE:
                length = int.from_bytes(data[p + 4 : p + 8], "little")
                if len(data) - p < length:
                    if p > 0 or length > seg_end - pos:
                        break
                    data = yield seg, length, rel  # one batch larger than the budget
                    continue
                h = parse_header(data, p, verify=False)
                if h.base_offset != offset:
                    raise CorruptBatch(f"base offset {h.base_offset}, expected {offset}")
                start = Position(offset, pos + p)
                offset += h.count
                p += h.length
                out.append(ReadBatch(h, data[p - h.length + h.payload_start : p], start, Position(offset, pos + p)))
                budget -= h.length
                if budget <= 0:
                    return out
            if p == 0:
                raise CorruptBatch(f"no whole batch at byte {pos}")
            pos += p
        return out

    # ------------------------------------------------------------------ the time index

    def _unindexed(self, until: Position) -> tuple[_Segment, int] | None:
        """The first segment whose time index stops short of ``until`` (or of its own end), and how
        far into it the index must reach; None when the index covers the log up to ``until``."""
        segs = list(self._segments)  # a roll may append one from a worker thread
        for i, seg in enumerate(segs):
            if seg.base.pos >= until.pos:
                break
            upto = until.pos - seg.base.pos
            if i + 1 < len(segs):
                upto = min(upto, segs[i + 1].base.pos - seg.base.pos)
            if seg.times is None:
                seg.times = _Times(seg.base.offset)
            if seg.times.done < upto:
                return seg, upto
        return None

    def times_indexed(self, until: Position) -> bool:
        """The time index covers the log from :attr:`first` to ``until``: :meth:`find_time` may
        look up times before ``until`` now."""
        return self._unindexed(until) is None

    def index_times(self, until: Position, step: int) -> bool:
        """Extend the time index towards ``until`` (a batch boundary of the durable log) by one read
        of about ``step`` bytes (at least a batch header), and say whether it now covers the log up
        to ``until``. Only the batch headers count: a batch longer than the read is stepped over by
        its length, and the next read starts past it.

        On the loop, one read a call (on the PostgreSQL store, bytes older than the memory cache are
        a query bounded by its read_timeout): the caller pauses for the loop between calls. Raises
        CorruptBatch where the bytes are not the batches the log holds (as :meth:`read` would)."""
        behind = self._unindexed(until)
        if behind is None:
            return True
        seg, upto = behind
        times = seg.times
        assert times is not None
        at = times.done
        data = seg.file.pread(min(upto - at, max(step, HEADER_SIZE)), at)
        unpack = HEADER.unpack_from
        starts, highs, piece = times.starts, times.highs, self.time_index_bytes
        pieces, last_high = len(starts), highs[-1] if highs else None
        offset = times.next_offset
        n, p = len(data), 0
        try:
            while n - p >= HEADER_SIZE:
                length, magic, base, count, ts = _time_fields(unpack(data, p))
                rel = at + p
                if magic != MAGIC or base != offset or count < 0 or not HEADER_SIZE <= length <= upto - rel:
                    raise CorruptBatch(f"{seg.path}: no batch of offset {offset} at byte {rel}")
                if not starts or rel - starts[-1] >= piece:
                    starts.append(rel)
                    highs.append(max(highs[-1], ts) if highs else ts)
                elif ts > highs[-1]:
                    highs[-1] = ts
                offset += count
                p += length
            if p == 0:
                raise CorruptBatch(f"{seg.path}: no whole batch header at byte {at}")
        except CorruptBatch:  # the index stays as it was, covering what it covered
            del starts[pieces:], highs[pieces:]
            if last_high is not None:
                highs[-1] = last_high
            raise
        times.done, times.next_offset = at + p, offset
        return self._unindexed(until) is None

    def find_time(self, time_ms: int, limit: Position) -> Position | None:
        """Where the first batch from :attr:`first` to ``limit`` appended at or after ``time_ms``
        starts, in log order (a batch appended earlier may have been stamped later, see
        :class:`_Times`); None if no batch before ``limit`` was.

        The time index must cover the log up to ``limit`` (:meth:`index_times` said so, and nothing
        awaited since). Without a pause: a pass over the segments' indexes in memory, a binary
        search in one, and one read of at most ``time_index_bytes`` plus a header (on the
        PostgreSQL store, a query bounded by its read_timeout)."""
        if not self.times_indexed(limit):
            raise RuntimeError(f"{self.directory}: the time index does not reach {limit.token()}")
        for seg in list(self._segments):
            if seg.base.pos >= limit.pos:
                return None
            times = seg.times
            if times is None or not times.highs or times.highs[-1] < time_ms:
                continue
            k = bisect.bisect_left(times.highs, time_ms)
            start = times.starts[k]
            end = min(times.starts[k + 1] if k + 1 < len(times.starts) else times.done, limit.pos - seg.base.pos)
            if start >= end:
                return None  # the first batch stamped at or after time_ms lies past limit
            data = seg.file.pread(min(end - start, self.time_index_bytes + HEADER_SIZE), start)
            p = 0
            while start + p < end and len(data) - p >= HEADER_SIZE:
                length, _magic, base, _count, ts = _time_fields(HEADER.unpack_from(data, p))
                if ts >= time_ms:
                    return Position(base, seg.base.pos + start + p)
                p += length
            if start + p < end:
                raise CorruptBatch(f"{seg.path}: no whole batch header at byte {start + p}")
            return None  # that batch lies past limit, in the same piece
        return None


def _blocking(steps: _Steps[_R]) -> _R:
    """Run a read's steps with each file's blocking ``pread``."""
    try:
        need = next(steps)
        while True:
            seg, n, rel = need
            need = steps.send(seg.file.pread(n, rel))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        steps.close()


def _time_fields(fields: tuple[Any, ...]) -> tuple[int, int, int, int, int]:
    """A batch header's length, magic, base offset, record count and append time (of HEADER's fields)."""
    return fields[1], fields[2], fields[5], fields[6], fields[7]
