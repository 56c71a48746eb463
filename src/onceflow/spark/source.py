"""Reading onceflow streams from Spark: batch and Structured Streaming.

Spark offsets are ``{stream name: position}``: an onceflow offset token, or (where a limit cut an
append's messages apart) a :class:`Cut` inside one batch. A micro-batch is the exact range between
two such maps, and a ``format=records`` read with ``until`` returns exactly the batches in it, so a
batch Spark replays after a crash reads the same rows. Under ``read_committed`` (the default) the end
of a range is never past a stream's last stable offset, where every earlier transaction is decided,
so aborted data is left out the same way every time.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType, TimestampType

from ._http import Conn, Frame, StreamTail, byte_offset, record_offset
from .options import OptionError, Options

__all__ = [
    "Cut",
    "OnceflowBatchReader",
    "OnceflowStreamReader",
    "RangePartition",
    "arrow_schema",
    "find_cut",
    "source_schema",
]

_raw_decode = json.JSONDecoder().raw_decode
_DECIMAL = re.compile(r"[0-9]+")
_TOKEN = re.compile(r"[0-9]+_[0-9]+")
_split_array = msgspec.json.Decoder(list[msgspec.Raw]).decode


def source_schema(text_values: bool) -> StructType:
    return StructType(
        [
            StructField("stream", StringType(), False),
            StructField("offset", LongType(), False),
            StructField("timestamp", TimestampType(), False),
            StructField("value", StringType() if text_values else BinaryType(), True),
            StructField("content_type", StringType(), False),
        ]
    )


def is_text_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.startswith("text/")


@dataclass(frozen=True, slots=True)
class Cut:
    """A position in one stream, in the form the source's Spark offsets keep it.

    ``record`` is the record offset of the position; ``lo`` an offset token at or before the batch
    that holds it (a read from ``lo`` reaches it) and ``hi`` one after that record (a read up to
    ``hi`` holds it). A position between two batches is a plain token (``lo == hi``, written as the
    token alone: the offsets of earlier versions read as such). One inside a batch, where a
    per-trigger limit cut an append of many JSON messages, is written ``<record>@<lo>..<hi>``: a
    range ending there reads up to ``hi`` and keeps the rows before ``record``, the next one reads
    from ``lo`` and keeps the rows from ``record`` on. Row offsets are record offsets, so the split
    is exact whatever the batches around it hold (aborted ones included).
    """

    record: int
    lo: str
    hi: str

    @classmethod
    def at(cls, token: str) -> Cut:
        return cls(record_offset(token), token, token)

    @classmethod
    def parse(cls, text: str) -> Cut:
        if "@" not in text:
            return cls.at(text)
        record, _, span = text.partition("@")
        lo, sep, hi = span.partition("..")
        # as written: lo ("-1" from earlier versions) < record < hi, both offsets; anything else
        # (a corrupt checkpoint) would read other rows than the position stood for
        if not (
            sep
            and _DECIMAL.fullmatch(record)
            and (lo == "-1" or _TOKEN.fullmatch(lo))
            and _TOKEN.fullmatch(hi)
            and record_offset(lo) < int(record) < record_offset(hi)
        ):
            raise ValueError(
                f"{text!r} is not a position of the onceflow source (<record>@<offset>..<offset>, the record "
                "between the two): is the query's checkpoint damaged?"
            )
        return cls(int(record), lo, hi)

    @property
    def inside(self) -> bool:
        """Whether the position is inside a batch (not a batch boundary)."""
        return self.lo != self.hi

    def __str__(self) -> str:
        return f"{self.record}@{self.lo}..{self.hi}" if self.inside else self.lo


def find_cut(conn: Conn, opts: Options, stream: str, start: Cut, record: int, until: str) -> Cut:
    """The position of ``record`` (``start.record < record < record_offset(until)``) of ``stream``:
    the boundary there, or a :class:`Cut` inside the batch that holds it. Two ``format=boundaries``
    scans at most: where a read of the records before ``record`` ends (the last boundary at or
    before it), then where the batch after that ends (the first boundary past it).

    When retention deleted ``start`` (``offsetReset`` = ``earliest``), the records it deleted are
    not counted: the position is as many records past the earliest offset kept as ``record`` is
    past ``start`` (else a limited query would go through them in empty micro-batches).

    A cut never starts at ``-1``: a read from there starts wherever the stream begins when it is
    read, so a later read of the rest of the append would miss (without an error) what retention
    deleted meanwhile. From ``-1``, the stream's earliest offset now is where the scan begins."""
    lo = start.lo
    if lo == "-1":
        began = end = conn.earliest(stream)
    else:
        _, end, began = conn.boundaries_from(
            stream, lo, until, isolation=opts.isolation, max_records=max(1, record - record_offset(lo))
        )
    if began != lo:  # from -1, or retention deleted lo: go on from the earliest offset kept
        gap = max(0, record_offset(began) - start.record)  # records past start it deleted
        if record + gap >= record_offset(until):
            return Cut.at(until)
        rest = Cut(start.record, began, start.hi) if record_offset(began) < start.record else Cut.at(began)
        return find_cut(conn, opts, stream, rest, record + gap, until)
    if record_offset(end) == record:
        return Cut.at(end)
    if record_offset(end) > record:  # the first batch from lo holds record (a read takes at least one batch)
        return Cut(record, lo, end)
    lo = end
    _, hi = conn.boundaries(stream, lo, until, isolation=opts.isolation, max_records=record - record_offset(lo))
    if record_offset(hi) <= record:  # not a batch that holds it (the range changed?): cut between batches
        return Cut.at(hi)
    return Cut(record, lo, hi)


class RangePartition(InputPartition):
    """The records of one stream from ``start`` (inclusive) to ``end`` (exclusive); each is an
    offset token or a :class:`Cut` written as text."""

    def __init__(self, stream: str, start: str, end: str, content_type: str) -> None:
        super().__init__((stream, start, end))
        self.stream = stream
        self.start = start
        self.end = end
        self.content_type = content_type


def split_json_bytes(payload: bytes) -> list[bytes]:
    """The message texts of a stored JSON payload (compact texts, each followed by a comma), as
    UTF-8: msgspec finds them in C (~0.2 us a row, against ~1.7 us for the json module's
    raw_decode); a payload it refuses (a lone surrogate escape, which the server stores) is split by
    the json module."""
    if not payload:
        return []
    try:
        return [bytes(raw) for raw in _split_array(b"[" + payload[:-1] + b"]")]
    except (msgspec.DecodeError, RecursionError):
        text = payload.decode("utf-8")
        out: list[bytes] = []
        i, n = 0, len(text)
        while i < n:
            _, j = _raw_decode(text, i)
            out.append(text[i:j].encode("utf-8"))
            i = j + 1
        return out


def split_json(payload: bytes) -> list[str]:
    """The message texts of a stored JSON payload, as text."""
    return [t.decode("utf-8") for t in split_json_bytes(payload)]


def _json_values(stream: str, frames: list[Frame]) -> pa.Array:
    """The message texts of JSON frames as one binary column, built from the payloads' bytes and
    the texts' lengths (~0.09 us a row, against ~0.26 us for a ``bytes`` object per row).

    A stored payload is compact texts each followed by one comma, so the payloads joined are the
    column's data with a comma after each value: offsets from the lengths, then one slice in C
    drops the commas. A frame is laid out so exactly when msgspec reads it and its texts' lengths
    plus one byte each add up to its payload's length (there is then no room for anything but one
    comma between texts). A batch with any frame not laid out so (never written by this server, but
    a payload is data from disk) is taken text by text."""
    lengths: list[int] = []
    laid_out = True
    for f in frames:
        try:
            texts: list[Any] = _split_array(b"[" + f.payload[:-1] + b"]") if f.payload else []
        except (msgspec.DecodeError, RecursionError):
            texts = split_json_bytes(f.payload)
            laid_out = False
        if len(texts) != f.count:
            raise ValueError(
                f"stream {stream}: batch at record {f.base_offset} holds {len(texts)} messages, header says {f.count}"
            )
        sizes = list(map(len, texts))
        laid_out = laid_out and sum(sizes) + len(sizes) == len(f.payload)
        lengths.extend(sizes)
    n = len(lengths)
    data = b"".join(f.payload for f in frames)
    if n and (not laid_out or len(data) >= 2**31):
        return pa.array([t for f in frames for t in split_json_bytes(f.payload)], pa.binary())
    ends = np.cumsum(np.fromiter(lengths, np.int64, n) + 1)
    offsets = np.zeros(n + 1, np.int32)
    offsets[1:] = ends
    with_commas = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return pc.binary_slice(with_commas, 0, -1)


def frames_to_arrow(stream: str, content_type: str, frames: list[Frame], text_values: bool) -> pa.RecordBatch:
    """One Arrow record batch of rows: one row per JSON message, one per append on other streams."""
    json_stream = content_type.split(";", 1)[0].strip().lower() == "application/json"
    counts = np.fromiter((f.count for f in frames), np.int64, len(frames))
    n = int(counts.sum())
    if json_stream:
        column = _json_values(stream, frames)  # text values: checked as UTF-8 by Arrow's cast below
        if text_values:
            column = column.cast(pa.string())
    elif text_values:
        column = pa.array([f.payload.decode("utf-8", "replace") for f in frames], pa.string())
    else:
        column = pa.array([f.payload for f in frames], pa.binary())
    # each row's offset counts from its batch's first; each row has its batch's time
    bases = np.fromiter((f.base_offset for f in frames), np.int64, len(frames))
    before = np.cumsum(counts) - counts  # rows of the earlier batches
    offsets = np.repeat(bases - before, counts) + np.arange(n, dtype=np.int64)
    stamps = np.repeat(np.fromiter((f.timestamp_ms for f in frames), np.int64, len(frames)) * 1000, counts)
    return pa.RecordBatch.from_arrays(
        [
            pa.repeat(pa.scalar(stream, pa.string()), n),
            pa.array(offsets, pa.int64()),
            pa.array(stamps, pa.timestamp("us", tz="UTC")),
            column,
            pa.repeat(pa.scalar(content_type, pa.string()), n),
        ],
        schema=_ARROW_TEXT if text_values else _ARROW_BINARY,
    )


def _arrow_schema(value: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            pa.field("stream", pa.string(), nullable=False),
            pa.field("offset", pa.int64(), nullable=False),
            pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
            pa.field("value", value),
            pa.field("content_type", pa.string(), nullable=False),
        ]
    )


_ARROW_TEXT = _arrow_schema(pa.string())
_ARROW_BINARY = _arrow_schema(pa.binary())


def arrow_schema(text_values: bool) -> pa.Schema:
    """The Arrow schema of the rows the source reads: ``value`` a string (``text_values``) or binary."""
    return _ARROW_TEXT if text_values else _ARROW_BINARY


def read_partition(opts: Options, part: RangePartition, text_values: bool) -> Iterator[pa.RecordBatch]:
    """The rows of the partition: the batches from its start's ``lo`` to its end's ``hi``, less the
    rows before the start's record and from the end's record on when either is inside a batch."""
    start, end = Cut.parse(part.start), Cut.parse(part.end)
    trim = start.inside or end.inside
    with opts.connect() as conn:
        for frames, _ in conn.read_frames(part.stream, start.lo, end.hi, isolation=opts.isolation):
            if not frames:
                continue
            rows = frames_to_arrow(part.stream, part.content_type, frames, text_values)
            if trim:  # row offsets rise within a read: keep [start.record, end.record)
                offsets = rows.column(1).to_numpy()
                a, b = np.searchsorted(offsets, [start.record, end.record])
                rows = rows.slice(int(a), int(b - a))
            if rows.num_rows:
                yield rows


def split_ranges(
    conn: Conn, opts: Options, stream: str, start: str, end: str, content_type: str
) -> list[RangePartition]:
    """One partition per stream range, a long range split every ``maxRecordsPerPartition`` records
    (at batch boundaries)."""
    first, last = Cut.parse(start), Cut.parse(end)
    if first.record >= last.record:
        return []
    if last.record - first.record <= opts.max_records_per_partition:
        return [RangePartition(stream, start, end, content_type)]
    marks, _ = conn.boundaries(
        stream, first.lo, last.hi, isolation=opts.isolation, every=opts.max_records_per_partition
    )
    inner = [m for m in marks if first.record < record_offset(m) < last.record]
    points = [start, *inner, end]
    return [RangePartition(stream, a, b, content_type) for a, b in zip(points, points[1:], strict=False) if a != b]


def plan(
    conn: Conn, opts: Options, ranges: Mapping[str, tuple[str, str]], types: Mapping[str, str]
) -> list[RangePartition]:
    """The partitions of a batch: each stream's range split by :func:`split_ranges`; then, with
    ``minPartitions``, the longest ones cut further (inside batches too, at exact records) until
    there are at least that many, each range into pieces in proportion to its records."""
    parts: list[RangePartition] = []
    for name in sorted(ranges):
        start, end = ranges[name]
        parts += split_ranges(conn, opts, name, start, end, types[name])
    want = opts.min_partitions
    if want is None or len(parts) >= want:
        return parts
    sizes = [Cut.parse(p.end).record - Cut.parse(p.start).record for p in parts]
    total = sum(sizes)
    out: list[RangePartition] = []
    for part, size in zip(parts, sizes, strict=True):
        pieces = min(size, max(1, math.ceil(size * want / total)))
        at = Cut.parse(part.start)
        last = Cut.parse(part.end)
        for i in range(1, pieces):
            record = at.record + (last.record - at.record) // (pieces - i + 1)
            if not at.record < record < last.record:
                continue
            nxt = find_cut(conn, opts, part.stream, at, record, last.hi)
            if not at.record < nxt.record < last.record:
                continue
            out.append(RangePartition(part.stream, str(at), str(nxt), part.content_type))
            at = nxt
        out.append(RangePartition(part.stream, str(at), part.end, part.content_type))
    return out


class _Streams:
    """The streams a query reads (a fixed list, or every stream under a prefix) and their ends."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.types: dict[str, str] = {}

    def ends(self, conn: Conn) -> dict[str, str]:
        """Each stream's end for this isolation: the last stable offset, or the tail."""
        infos: list[StreamTail]
        if self.opts.pattern is not None:
            infos = conn.list_streams(self.opts.pattern)
        else:
            infos = []
            for name in self.opts.streams:
                info = conn.head(name)
                if info is None:
                    raise ValueError(f"onceflow stream {name!r} does not exist at {self.opts.url}")
                infos.append(info)
        committed = self.opts.isolation == "read_committed"
        out = {}
        for info in infos:
            self.types[info.name] = info.content_type
            out[info.name] = info.stable_offset if committed else info.next_offset
        return out

    def starts(self, conn: Conn, ends: Mapping[str, str]) -> dict[str, str]:
        """Where a new query or a batch read starts: ``startingOffsets``, except the streams
        ``startingTimestamp`` or ``startingOffsetsByTimestamp`` name, which start at their first
        batch appended at or after that time (looked up by the server: ``format=position``), or at
        their end when none was."""
        out = self.opts.starting(ends)
        times: Mapping[str, int]
        if self.opts.starting_timestamp is not None:
            times = dict.fromkeys(ends, self.opts.starting_timestamp)
        else:
            times = self.opts.starting_by_timestamp or {}
            unknown = sorted(set(times) - set(ends))
            if unknown:
                raise OptionError(
                    f"option startingOffsetsByTimestamp names streams this query does not read: {unknown}"
                )
        for name, time_ms in times.items():
            out[name] = conn.position_at(name, time_ms)
        return out


class OnceflowBatchReader(DataSourceReader):
    """``spark.read.format("onceflow")``: the streams from ``startingOffsets`` to ``endingOffsets``."""

    def __init__(self, opts: Options, text_values: bool) -> None:
        self.opts = opts
        self.text_values = text_values

    def partitions(self) -> Sequence[InputPartition]:
        streams = _Streams(self.opts)
        with self.opts.connect() as conn:
            ends = streams.ends(conn)
            starts = streams.starts(conn, ends)
            limit = self.opts.ending(ends)
            ranges = {name: (starts.get(name, "-1"), limit[name]) for name in ends}
            return plan(conn, self.opts, ranges, streams.types)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(self.opts, partition, self.text_values)


class OnceflowStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("onceflow")``.

    Offsets are ``{stream: position}`` (:class:`Cut`); a stream that appears later (with
    ``pattern``) is read from its start. The per-trigger limits count rows, the rows Spark gets:
    ``maxRecordsPerTrigger`` (or ``maxOffsetsPerTrigger``) and ``maxBytesPerTrigger`` bound a
    micro-batch, shared between the streams that have data, and cut an append of many JSON messages
    where the limit falls; ``minOffsetsPerTrigger`` holds a micro-batch back until that many rows
    wait or ``maxTriggerDelay`` passed since the last one. ``Trigger.AvailableNow`` reads up to the
    ends seen when the query started in bounded micro-batches, then stops: it never waits for
    ``minOffsetsPerTrigger``. Spark may ask for everything (``ReadAllAvailable``, as
    ``Trigger.Once`` does): then no limit applies.
    """

    def __init__(self, opts: Options, text_values: bool) -> None:
        self.opts = opts
        self.text_values = text_values
        self.streams = _Streams(opts)
        self._conn: Conn | None = None
        self.target: dict[str, str] | None = None
        self.clock: Callable[[], float] = time.monotonic  # maxTriggerDelay counts on it
        self.last_batch = self.clock()  # when the last micro-batch was planned (or the reader made)

    @property
    def conn(self) -> Conn:
        """The driver's connection (made on first use: the reader is pickled for the tasks)."""
        if self._conn is None:
            self._conn = self.opts.connect()
        return self._conn

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_conn"] = None
        return state

    def initialOffset(self) -> dict[str, str]:
        ends = self.streams.ends(self.conn)
        return self.streams.starts(self.conn, ends)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self.streams.ends(self.conn)

    def getDefaultReadLimit(self) -> ReadLimit:
        """Spark takes one limit from a Python source (no composite limit): the first of
        ``maxRecordsPerTrigger``, ``maxBytesPerTrigger``, ``minOffsetsPerTrigger`` set. The others
        set apply all the same: :meth:`latestOffset` reads them from the options."""
        if self.opts.max_records_per_trigger is not None:
            return ReadMaxRows(self.opts.max_records_per_trigger)
        if self.opts.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.opts.max_bytes_per_trigger)
        if self.opts.min_records_per_trigger is not None:
            return ReadMinRows(self.opts.min_records_per_trigger)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, str]:
        """Each stream's end now (its last stable offset under read_committed): the query's
        progress shows it as the source's ``latestOffset``, beside the micro-batch's ``endOffset``."""
        return self.streams.ends(self.conn)

    def latestOffset(self, start: dict[str, str], limit: ReadLimit | None = None) -> dict[str, str]:
        ends = self.target if self.target is not None else self.streams.ends(self.conn)
        out = dict(start)
        backlog: dict[str, tuple[Cut, str]] = {}
        for name, end in ends.items():
            begin = start.get(name, "-1")
            if begin == "-1" and end == "-1":
                continue
            out.setdefault(name, "-1")
            first = Cut.parse(begin)
            if record_offset(end) > first.record:
                backlog[name] = (first, end)
        everything = limit is None or isinstance(limit, ReadAllAvailable)
        max_rows = None if everything else self.opts.max_records_per_trigger
        max_bytes = None if everything else self.opts.max_bytes_per_trigger
        min_rows = None if everything else self.opts.min_records_per_trigger
        if isinstance(limit, ReadMaxRows):
            max_rows = limit.max_rows
        elif isinstance(limit, ReadMaxBytes):
            max_bytes = limit.max_bytes
        elif isinstance(limit, ReadMinRows):
            min_rows = limit.min_rows
        waiting = sum(record_offset(end) - first.record for first, end in backlog.values())
        now = self.clock()
        if (
            min_rows is not None
            and self.target is None  # Trigger.AvailableNow reads what is there, never waits
            and waiting < min_rows
            and now - self.last_batch < self.opts.max_trigger_delay_ms / 1000
        ):
            return dict(start)  # no new micro-batch yet
        row_budget = math.inf if max_rows is None else max_rows
        byte_budget = math.inf if max_bytes is None else max_bytes
        order = sorted(backlog, key=lambda n: (record_offset(backlog[n][1]) - backlog[n][0].record, n))
        for i, name in enumerate(order):  # the smallest backlogs first: what they leave goes to the rest
            first, end = backlog[name]
            left = len(order) - i
            rows = record_offset(end) - first.record
            want = rows
            per_record = max(
                1.0, (byte_offset(end) - byte_offset(first.lo)) / max(1, record_offset(end) - record_offset(first.lo))
            )
            if row_budget <= 0 or byte_budget <= 0:
                break
            if row_budget != math.inf:
                want = min(want, max(1, int(row_budget // left)))
            if byte_budget != math.inf:  # at least one row, however large
                want = min(want, max(1, int(byte_budget // left // per_record)))
            out[name] = (
                end if want >= rows else str(find_cut(self.conn, self.opts, name, first, first.record + want, end))
            )
            took = min(want, Cut.parse(out[name]).record - first.record)  # not records retention deleted
            row_budget -= took
            byte_budget -= took * per_record
        if out != start:
            self.last_batch = now
        return out

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> Sequence[InputPartition]:
        ranges: dict[str, tuple[str, str]] = {}
        for name in sorted(end):
            content_type = self.streams.types.get(name)
            if content_type is None:
                info = self.conn.head(name)
                content_type = info.content_type if info is not None else "application/octet-stream"
                self.streams.types[name] = content_type
            ranges[name] = (start.get(name, "-1"), end[name])
        return plan(self.conn, self.opts, ranges, self.streams.types)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(self.opts, partition, self.text_values)

    def commit(self, end: dict[str, str]) -> None:
        # Spark keeps the offsets in its checkpoint. With option group, the server learns them too:
        # a stream that names the group (Stream-Retention-Keep-Groups) then keeps what the query
        # may still replay (a batch is replayed from the previous batch's end after a failure).
        # A position inside a batch commits the batch's start: the group's offset stays where a
        # read of the rest begins.
        if self.opts.group is not None:
            self.conn.commit_group(self.opts.group, {name: Cut.parse(pos).lo for name, pos in end.items()})

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
