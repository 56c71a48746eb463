"""Reading onceflow streams from Spark: batch and Structured Streaming.

Spark offsets are ``{stream name: onceflow offset token}``. A micro-batch is the exact range between
two such maps, and a ``format=records`` read with ``until`` returns exactly the batches in it, so a
batch Spark replays after a crash reads the same rows. Under ``read_committed`` (the default) the end
of a range is never past a stream's last stable offset, where every earlier transaction is decided,
so aborted data is left out the same way every time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType, TimestampType

from ._http import Conn, Frame, StreamTail, record_offset
from .options import Options

__all__ = ["OnceflowBatchReader", "OnceflowStreamReader", "RangePartition", "arrow_schema", "source_schema"]

_raw_decode = json.JSONDecoder().raw_decode
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


class RangePartition(InputPartition):
    """The records of one stream from ``start`` (inclusive) to ``end`` (exclusive)."""

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
    with opts.connect() as conn:
        for frames, _ in conn.read_frames(part.stream, part.start, part.end, isolation=opts.isolation):
            if frames:
                yield frames_to_arrow(part.stream, part.content_type, frames, text_values)


def split_ranges(
    conn: Conn, opts: Options, stream: str, start: str, end: str, content_type: str
) -> list[RangePartition]:
    """One partition per stream range, a long range split every ``maxRecordsPerPartition`` records."""
    if start == end:
        return []
    span = record_offset(end) - record_offset(start)
    if span <= opts.max_records_per_partition:
        return [RangePartition(stream, start, end, content_type)]
    marks, _ = conn.boundaries(stream, start, end, isolation=opts.isolation, every=opts.max_records_per_partition)
    points = [start, *marks, end]
    return [RangePartition(stream, a, b, content_type) for a, b in zip(points, points[1:], strict=False) if a != b]


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


class OnceflowBatchReader(DataSourceReader):
    """``spark.read.format("onceflow")``: the streams from ``startingOffsets`` to ``endingOffsets``."""

    def __init__(self, opts: Options, text_values: bool) -> None:
        self.opts = opts
        self.text_values = text_values

    def partitions(self) -> Sequence[InputPartition]:
        streams = _Streams(self.opts)
        with self.opts.connect() as conn:
            ends = streams.ends(conn)
            starts = self.opts.starting(ends)
            limit = self.opts.ending(ends)
            parts: list[RangePartition] = []
            for name in sorted(ends):
                parts += split_ranges(conn, self.opts, name, starts.get(name, "-1"), limit[name], streams.types[name])
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(self.opts, partition, self.text_values)


class OnceflowStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("onceflow")``.

    Offsets are ``{stream: token}``; a stream that appears later (with ``pattern``) is read from its
    start. ``maxRecordsPerTrigger`` bounds a micro-batch (shared fairly between the streams that have
    data); ``Trigger.AvailableNow`` reads up to the ends seen when the query started, then stops.
    """

    def __init__(self, opts: Options, text_values: bool) -> None:
        self.opts = opts
        self.text_values = text_values
        self.streams = _Streams(opts)
        self._conn: Conn | None = None
        self.target: dict[str, str] | None = None

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
        return self.opts.starting(ends)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self.streams.ends(self.conn)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_records_per_trigger is not None:
            return ReadMaxRows(self.opts.max_records_per_trigger)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, str]:
        return self.streams.ends(self.conn)

    def latestOffset(self, start: dict[str, str], limit: ReadLimit | None = None) -> dict[str, str]:
        ends = self.target if self.target is not None else self.streams.ends(self.conn)
        out = dict(start)
        backlog = {}
        for name, end in ends.items():
            begin = start.get(name, "-1")
            if begin == "-1" and end == "-1":
                continue
            out.setdefault(name, "-1")
            if record_offset(end) > record_offset(begin):
                backlog[name] = (begin, end)
        if not isinstance(limit, ReadMaxRows):
            for name, (_, end) in backlog.items():
                out[name] = end
            return out
        budget = limit.max_rows
        share = max(1, budget // max(1, len(backlog)))
        for name in sorted(backlog):  # a fair share each, so one busy stream cannot starve the rest
            begin, end = backlog[name]
            want = min(share, budget)
            if want <= 0:
                break
            if record_offset(end) - record_offset(begin) <= want:
                out[name] = end
            else:
                _, out[name] = self.conn.boundaries(name, begin, end, isolation=self.opts.isolation, max_records=want)
            budget -= record_offset(out[name]) - record_offset(begin)
        return out

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> Sequence[InputPartition]:
        parts: list[RangePartition] = []
        for name in sorted(end):
            content_type = self.streams.types.get(name)
            if content_type is None:
                info = self.conn.head(name)
                content_type = info.content_type if info is not None else "application/octet-stream"
                self.streams.types[name] = content_type
            parts += split_ranges(self.conn, self.opts, name, start.get(name, "-1"), end[name], content_type)
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(self.opts, partition, self.text_values)

    def commit(self, end: dict[str, str]) -> None:
        # Spark keeps the offsets in its checkpoint. With option group, the server learns them too:
        # a stream that names the group (Stream-Retention-Keep-Groups) then keeps what the query
        # may still replay (a batch is replayed from the previous batch's end after a failure).
        if self.opts.group is not None:
            self.conn.commit_group(self.opts.group, end)

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
