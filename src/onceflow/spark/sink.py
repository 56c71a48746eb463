"""Writing to onceflow from Spark, exactly once.

Each task writes its rows inside its own onceflow transaction (transactional id
``spark/<sink>/p<partition>/a<attempt>``) and leaves it open; its commit message names the
transaction. The driver's ``commit(messages, batchId)`` then asks the server to commit all of them
as **one** decision that also records ``batchId`` as the sink's last committed batch
(``POST /v1/sinks/<sink>/commit``). So:

- a micro-batch becomes visible to read_committed readers all at once, or not at all;
- Spark re-running batch N after a crash (even when ``commit(N)`` had returned but Spark had not
  yet written its commit log) commits nothing: the server answers ``already_committed`` and aborts
  the re-run's transactions; tasks that see the batch is already committed skip writing at all;
- a failed or speculative task attempt has its own transactional id, and whatever it left open is
  aborted by the batch's commit or abort (everything under ``spark/<sink>/`` not named is aborted),
  so a retry adds nothing twice.

Nothing is keyed on Spark's (partitionId, epochId) pair alone (SPARK-28650): the batch id is the key,
read inside the task from the ``streaming.sql.batchId`` local property.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from ..client.transactions import TransactionalProducer
from .options import OptionError, Options

__all__ = ["OnceflowBatchWriter", "OnceflowStreamWriter", "TaskCommit", "check_sink_schema"]

log = logging.getLogger("onceflow.spark")


@dataclass
class TaskCommit(WriterCommitMessage):
    """What one task wrote: its open transaction (``txn`` None when it wrote nothing)."""

    transactional_id: str
    epoch: int
    txn: int | None
    rows: int
    skipped: bool = False

    def member(self) -> dict[str, Any] | None:
        if self.txn is None:
            return None
        return {"id": self.transactional_id, "epoch": self.epoch, "txn": self.txn}


def check_sink_schema(schema: StructType, opts: Options) -> None:
    names = {f.name: f.dataType for f in schema.fields}
    if "value" not in names:
        raise OptionError(f"the onceflow sink writes the column 'value' (string or binary); the DataFrame has {sorted(names)}")
    if not isinstance(names["value"], StringType | BinaryType):
        raise OptionError(f"column 'value' must be a string or binary, not {names['value'].simpleString()}: use to_json() or cast")
    if "stream" in names and not isinstance(names["stream"], StringType):
        raise OptionError("column 'stream' must be a string (the name of the stream each row goes to)")
    if "stream" not in names and not opts.stream:
        raise OptionError('say where rows go: .option("stream", "name"), or a string column "stream"')


def _write_task(opts: Options, prefix: str, batches: Iterator[pa.RecordBatch], sink: str | None = None,
                batch: int | None = None) -> TaskCommit:
    """Write this task's rows inside one transaction (``<prefix>p<partition>/a<attempt>``) and
    leave it open for the driver. With ``sink`` and ``batch``: write nothing when the sink has
    already committed that batch (a replay)."""
    partition, attempt = _task()
    tid = f"{prefix}p{partition}/a{attempt}"
    created: set[str] = set()  # target streams known to exist
    rows = 0
    with opts.connect() as conn:
        if sink is not None and batch is not None:
            done = conn.sink_progress(sink)
            if done is not None and batch <= done:
                return TaskCommit(tid, -1, None, 0, skipped=True)
        with TransactionalProducer(
            opts.url, tid, timeout_ms=opts.transaction_timeout_ms, delivery_timeout=opts.request_deadline, token=opts.token,
        ) as producer:
            for rb in batches:
                if rb.num_rows == 0:
                    continue
                values = rb.column(rb.schema.get_field_index("value"))
                idx = rb.schema.get_field_index("stream")
                if idx >= 0:
                    groups: dict[str, list[Any]] = {}
                    for target, value in zip(rb.column(idx).to_pylist(), values.to_pylist(), strict=True):
                        if target is None:
                            raise ValueError("a row has no stream (the 'stream' column is null)")
                        groups.setdefault(target, []).append(value)
                else:
                    assert opts.stream is not None
                    groups = {opts.stream: values.to_pylist()}
                for target, vals in groups.items():
                    if target not in created:
                        conn.ensure_stream(target, opts.content_type)
                        created.add(target)
                    if any(v is None for v in vals):
                        raise ValueError(f"a row for stream {target!r} has a null value")
                    producer.extend(target, [v.encode() if isinstance(v, str) else v for v in vals])
                    rows += len(vals)
            producer.flush()
            return TaskCommit(tid, producer.epoch, producer.txn, rows)


def _members(messages: list[WriterCommitMessage | None]) -> list[dict[str, Any]]:
    """The transactions the tasks left open for the driver to commit (or abort)."""
    out = []
    for msg in messages:
        member = msg.member() if isinstance(msg, TaskCommit) else None
        if member is not None:
            out.append(member)
    return out


def _task() -> tuple[int, int]:
    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("the onceflow sink's write() runs inside a Spark task")
    return ctx.partitionId(), ctx.attemptNumber()


class OnceflowStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("onceflow")``: each micro-batch is committed once, atomically."""

    def __init__(self, opts: Options, sink_id: str) -> None:
        self.opts = opts
        self.sink_id = sink_id
        self.prefix = f"spark/{sink_id}/"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TaskCommit:
        ctx = TaskContext.get()
        raw = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
        if raw is None:
            raise RuntimeError("the onceflow stream writer found no streaming.sql.batchId in its task")
        return _write_task(self.opts, self.prefix, iterator, self.sink_id, int(raw))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 (Spark's name)
        members = _members(messages)
        with self.opts.connect() as conn:
            result = conn.commit_members(self.sink_id, batchId, members, self.prefix)
        if result["status"] == "already_committed":
            log.info("onceflow sink %s: batch %d was already committed (last: %s); nothing added", self.sink_id, batchId, result["batch"])

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        members = _members(messages)
        with self.opts.connect() as conn:
            conn.abort_members(self.sink_id, members, self.prefix)


class OnceflowBatchWriter(DataSourceArrowWriter):
    """``df.write.format("onceflow")``: the whole job's rows become visible at once, or none do.

    With ``sinkId`` and ``batchId`` options (typically inside ``foreachBatch(df, batch_id)``) the
    write is also recorded as that sink's batch, so a replayed batch id adds nothing: this is how a
    query in update or complete mode writes to onceflow exactly once.
    """

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.batch = opts.batch_id
        if self.batch is not None:
            if opts.sink_id is None:
                raise OptionError('option batchId needs option sinkId: the sink whose batches it numbers')
            self.job = opts.sink_id
            self.prefix = f"spark/{opts.sink_id}/"
        else:
            self.job = f"{opts.sink_id or 'batch'}-{uuid.uuid4().hex[:12]}"  # one write job: no '/' (a sink id)
            self.prefix = f"spark-batch/{self.job}/"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TaskCommit:
        return _write_task(self.opts, self.prefix, iterator, self.job, self.batch)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        with self.opts.connect() as conn:
            result = conn.commit_members(self.job, self.batch, _members(messages), self.prefix)
        if result["status"] == "already_committed":
            log.info("onceflow sink %s: batch %s was already committed; nothing added", self.job, self.batch)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        with self.opts.connect() as conn:
            conn.abort_members(self.job, _members(messages), self.prefix)
