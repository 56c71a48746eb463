"""Writing to onceflow from Spark, exactly once: the Spark glue of ``spark/protocol.py``.

Each task attempt begins on the server (which checks that the sink belongs to this query and hands
out the task's transactional id), writes its rows inside that transaction and leaves it open; its
commit message names the transaction and a fingerprint of its rows. The driver's
``commit(messages, batchId)`` then asks the server to commit all of them as **one** decision that
also records ``batchId`` as the sink's last committed batch (``POST /v1/sinks/<sink>/commit``). So:

- a micro-batch becomes visible to read_committed readers all at once, or not at all;
- Spark re-running batch N after a crash (even when ``commit(N)`` had returned but Spark had not
  yet written its commit log) adds nothing: the tasks learn that N is committed and write nothing,
  and the commit answers ``already_committed`` (or refuses a replay over other rows);
- a failed, late or speculative task attempt is fenced by its batch's commit or abort, so a retry
  adds nothing twice and nothing holds the last stable offset;
- another query (a new checkpoint location) under the same ``sinkId`` is refused loudly.

Nothing is keyed on Spark's (partitionId, epochId) pair alone (SPARK-28650): the batch id and the
query id are read inside the task from the ``streaming.sql.batchId`` and ``sql.streaming.queryId``
local properties (both are set for the tasks of a streaming write and inside ``foreachBatch``),
and a task attempt is named by Spark's ``taskAttemptId()``, unique across stage attempts.

This module only reads Spark's task context and converts Arrow batches into plain values; what a
task and the driver do is in ``protocol.py``, run on the client's background loop (``run_sync``),
so a task's keep-alives go on while its thread waits for its input.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from ..client.lowlevel import async_http_client, run_sync
from .options import OptionError, Options
from .protocol import (
    SinkTask,
    TaskResult,
    TaskSpec,
    WriterSettings,
    abort_batch,
    attempt_timeout,
    commit_batch,
    task_name,
)

__all__ = ["OnceflowBatchWriter", "OnceflowStreamWriter", "TaskCommit", "check_sink_schema"]

log = logging.getLogger("onceflow.spark")


@dataclass
class TaskCommit(WriterCommitMessage):
    """What one task wrote (Spark's commit message): its :class:`~.protocol.TaskResult`."""

    result: TaskResult

    @property
    def transactional_id(self) -> str:
        return self.result.transactional_id

    @property
    def txn(self) -> int | None:
        return self.result.txn

    @property
    def rows(self) -> int:
        return self.result.rows

    @property
    def skipped(self) -> bool:
        return self.result.skipped


def check_sink_schema(schema: StructType, opts: Options) -> None:
    names = {f.name: f.dataType for f in schema.fields}
    if "value" not in names:
        raise OptionError(
            f"the onceflow sink writes the column 'value' (string or binary); the DataFrame has {sorted(names)}"
        )
    if not isinstance(names["value"], StringType | BinaryType):
        raise OptionError(
            f"column 'value' must be a string or binary, not {names['value'].simpleString()}: use to_json() or cast"
        )
    if "stream" in names and not isinstance(names["stream"], StringType):
        raise OptionError("column 'stream' must be a string (the name of the stream each row goes to)")
    if "stream" not in names and not opts.stream:
        raise OptionError('say where rows go: .option("stream", "name"), or a string column "stream"')


def _rows(rb: pa.RecordBatch, opts: Options) -> dict[str, list[bytes]]:
    """One Arrow batch as encoded messages per target stream."""
    column = rb.column(rb.schema.get_field_index("value"))
    if not pa.types.is_binary(column.type):  # a string column: its UTF-8 as is (a str per row cost ~0.24 us more)
        column = column.cast(pa.binary())
    values: list[bytes | None] = column.to_pylist()
    idx = rb.schema.get_field_index("stream")
    groups: dict[str, list[bytes | None]] = {}
    if idx < 0 and column.null_count == 0:  # the common case, checked by Arrow and not row by row
        assert opts.stream is not None
        return {opts.stream: values}  # type: ignore[dict-item]  # (no None: no nulls)
    if idx >= 0:
        for target, value in zip(rb.column(idx).to_pylist(), values, strict=True):
            if target is None:
                raise ValueError("a row has no stream (the 'stream' column is null)")
            groups.setdefault(target, []).append(value)
    else:
        assert opts.stream is not None
        groups = {opts.stream: values}
    out: dict[str, list[bytes]] = {}
    for target, vals in groups.items():
        if any(v is None for v in vals):
            raise ValueError(f"a row for stream {target!r} has a null value")
        out[target] = vals  # type: ignore[assignment]  # (no None: checked above)
    return out


async def _client(opts: Options) -> httpx.AsyncClient:
    """The client of a task or of the driver: each attempt of a request waits at most
    :func:`~.protocol.attempt_timeout` of ``requestTimeoutSeconds`` (the tasks' appends and
    keep-alives too), not a fixed time that could outlast the deadline."""
    return async_http_client(opts.url, timeout=attempt_timeout(opts.request_deadline), token=opts.token)


def _context() -> TaskContext:
    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("the onceflow sink's write() runs inside a Spark task")
    return ctx


def _write_task(
    opts: Options, settings: WriterSettings, spec: TaskSpec, batches: Iterator[pa.RecordBatch]
) -> TaskCommit:
    """Run one task of the sink (``protocol.SinkTask``) over this task's Arrow batches."""
    client = run_sync(_client(opts))
    try:
        task = run_sync(SinkTask.begin(client, settings, spec))
        try:
            if task.reads_input:
                for rb in batches:
                    if rb.num_rows:
                        run_sync(task.write(_rows(rb, opts)))
            return TaskCommit(run_sync(task.finish()))
        except BaseException:
            run_sync(task.abandon())
            raise
    finally:
        run_sync(client.aclose())


def _results(messages: list[WriterCommitMessage | None]) -> list[TaskResult | None]:
    return [m.result if isinstance(m, TaskCommit) else None for m in messages]


async def _commit(
    opts: Options, settings: WriterSettings, batch: int | None, messages: list[WriterCommitMessage | None]
) -> str:
    async with await _client(opts) as client:
        outcome = await commit_batch(client, settings, batch, _results(messages))
    return outcome.status


async def _abort(
    opts: Options, settings: WriterSettings, batch: int | None, messages: list[WriterCommitMessage | None]
) -> None:
    async with await _client(opts) as client:
        await abort_batch(client, settings, batch, _results(messages))


class OnceflowStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("onceflow")``: each micro-batch is committed once, atomically."""

    def __init__(self, opts: Options, sink_id: str) -> None:
        self.opts = opts
        self.sink_id = sink_id
        self.run = uuid.uuid4().hex[:12]  # names this writer's task attempts apart from any other's
        self.settings = opts.writer_settings(sink_id)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TaskCommit:
        ctx = _context()
        raw = ctx.getLocalProperty("streaming.sql.batchId")
        if raw is None:
            raise RuntimeError("the onceflow stream writer found no streaming.sql.batchId in its task")
        spec = TaskSpec(
            int(raw),
            ctx.getLocalProperty("sql.streaming.queryId"),
            ctx.partitionId(),
            task_name(self.run, ctx.attemptNumber(), ctx.taskAttemptId()),
        )
        return _write_task(self.opts, self.settings, spec, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 (Spark's name)
        status = run_sync(_commit(self.opts, self.settings, batchId, messages))
        if status == "already_committed":
            log.info("onceflow sink %s: batch %d was already committed; nothing added", self.sink_id, batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        run_sync(_abort(self.opts, self.settings, batchId, messages))


class OnceflowBatchWriter(DataSourceArrowWriter):
    """``df.write.format("onceflow")``: the whole job's rows become visible at once, or none do.

    With ``sinkId`` and ``batchId`` options (typically inside ``foreachBatch(df, batch_id)``) the
    write is also recorded as that sink's batch, so a replayed batch id adds nothing: this is how a
    query in update or complete mode writes to onceflow exactly once.
    """

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.batch = opts.batch_id
        self.run = uuid.uuid4().hex[:12]
        if self.batch is not None:
            if opts.sink_id is None:
                raise OptionError("option batchId needs option sinkId: the sink whose batches it numbers")
            self.job = opts.sink_id
        else:
            self.job = f"{opts.sink_id or 'batch'}-{self.run}"  # one write job: no '/' (a sink id)
        self.settings = opts.writer_settings(self.job)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TaskCommit:
        ctx = _context()
        # inside foreachBatch the tasks see the streaming query's id: the sink is bound to it
        query = ctx.getLocalProperty("sql.streaming.queryId") if self.batch is not None else None
        spec = TaskSpec(
            self.batch, query, ctx.partitionId(), task_name(self.run, ctx.attemptNumber(), ctx.taskAttemptId())
        )
        return _write_task(self.opts, self.settings, spec, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        status = run_sync(_commit(self.opts, self.settings, self.batch, messages))
        if status == "already_committed":
            log.info("onceflow sink %s: batch %s was already committed; nothing added", self.job, self.batch)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        run_sync(_abort(self.opts, self.settings, self.batch, messages))
