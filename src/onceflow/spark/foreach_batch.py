"""``foreachBatch`` adapters: Spark micro-batches into PostgreSQL and Redis, exactly once.

::

    query = (df.writeStream
               .foreachBatch(postgres_sink(conninfo, "events", name="events-to-pg"))
               .option("checkpointLocation", "/chk/events-to-pg")
               .start())

Spark runs the function on the driver with each micro-batch and its batch id, and after a crash
runs the last batch again with the same id and the same input (when the source is replayable).
Each adapter writes the batch's rows **and** the batch id into the target in one atomic step,
and skips a batch id at or below the last one it committed, so a replayed batch adds nothing:

- :func:`postgres_sink`: one transaction: lock the sink's row of ``onceflow_spark_batches``, COPY
  the rows, set the row's ``batch_id``;
- :func:`redis_sink`: one Lua script: push the rows (JSON) to a list or a hash and set the
  ``batch_id`` of the frontier hash, keys in one Redis Cluster slot.

``name`` identifies the sink in the target; it belongs to one streaming query. The query's id (kept
in the checkpoint location) is stored beside the batch id, and a different query writing under the
same name is refused: a new checkpoint location restarts batch ids at 0, and would otherwise have
every batch skipped. Use a new name (or delete the sink's frontier) for a new query.

The rows are read on the driver (``toLocalIterator``): bound a micro-batch with the source's
``maxOffsetsPerTrigger`` / ``maxFilesPerTrigger`` when batches are large.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["PostgresBatchSink", "RedisBatchSink", "postgres_sink", "redis_sink"]

log = logging.getLogger("onceflow.spark")

BATCHES_TABLE = "onceflow_spark_batches"


def _query_id(df: Any) -> str:
    """The streaming query's id (stable across restarts on one checkpoint location), or ''."""
    try:
        qid = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext: run without the check
        return ""
    return str(qid) if qid else ""


def _check_batch_id(batch_id: Any) -> int:
    if isinstance(batch_id, bool) or not isinstance(batch_id, int) or batch_id < 0:
        raise TypeError(f"batch_id must be Spark's micro-batch id (an int >= 0), not {batch_id!r}")
    return batch_id


class PostgresBatchSink:
    """The function :func:`postgres_sink` returns: ``sink(df, batch_id)``.

    ``written`` and ``skipped`` count the batch ids it committed and the replays it skipped.
    """

    def __init__(self, conninfo: str, table: str, *, name: str, columns: Sequence[str] | None = None) -> None:
        from ..sinks.postgres import table_identifier

        if not name:
            raise ValueError("name must identify this sink in the database (one name per streaming query)")
        table_identifier(table)
        self.conninfo = conninfo
        self.table = table
        self.name = name
        self.columns = None if columns is None else list(columns)
        self.written = 0
        self.skipped = 0

    def __call__(self, df: Any, batch_id: int) -> None:
        import psycopg
        from psycopg import sql

        from ..sinks import SinkError
        from ..sinks.postgres import adapt, copy_rows, create_if_missing

        batch_id = _check_batch_id(batch_id)
        columns = self.columns or list(df.columns)
        query_id = _query_id(df)
        state = sql.Identifier(BATCHES_TABLE)
        with psycopg.connect(self.conninfo) as conn:
            create_if_missing(
                conn,
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (sink text PRIMARY KEY, batch_id bigint NOT NULL, "
                    "query_id text NOT NULL, committed_at timestamptz NOT NULL DEFAULT now())"
                ).format(state),
            )
            with conn.transaction():
                # Step 1: the sink's frontier row, locked until the commit (a concurrent run waits here)
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (sink, batch_id, query_id) VALUES (%s, -1, %s) ON CONFLICT (sink) DO NOTHING"
                    ).format(state),
                    (self.name, query_id),
                )
                row = conn.execute(
                    sql.SQL("SELECT batch_id, query_id FROM {} WHERE sink = %s FOR UPDATE").format(state), (self.name,)
                ).fetchone()
                assert row is not None
                last, owner = int(row[0]), str(row[1])
                if owner and query_id and owner != query_id:
                    raise SinkError(
                        f"sink {self.name!r} belongs to streaming query {owner}, not {query_id}: give this query "
                        f"its own name, or delete the sink's row from {BATCHES_TABLE} to start over"
                    )
                if batch_id <= last:
                    # Step 2a: a replay of a committed batch: nothing to write
                    log.info("sink %s: batch %d already committed (last %d); skipped", self.name, batch_id, last)
                    self.skipped += 1
                    return
                # Step 2: the rows, then Step 3: the frontier; the transaction's commit makes both visible
                rows = (tuple(adapt(r[c]) for c in columns) for r in _rows(df.select(*columns)))
                copy_rows(conn, self.table, columns, rows)
                conn.execute(
                    sql.SQL("UPDATE {} SET batch_id = %s, query_id = %s, committed_at = now() WHERE sink = %s").format(
                        state
                    ),
                    (batch_id, query_id or owner, self.name),
                )
        self.written += 1


class RedisBatchSink:
    """The function :func:`redis_sink` returns: ``sink(df, batch_id)``.

    ``written`` and ``skipped`` count the batch ids it committed and the replays it skipped.
    """

    def __init__(
        self, url: str, *, name: str, key: str | None = None, frontier_key: str | None = None, field: str | None = None
    ) -> None:
        from ..sinks.redis import same_slot

        if not name:
            raise ValueError("name must identify this sink in Redis (one name per streaming query)")
        self.url = url
        self.name = name
        self.key = key or f"onceflow:{{{name}}}:out"
        self.frontier_key = frontier_key or f"onceflow:{{{name}}}:batches"
        same_slot(self.key, self.frontier_key)
        self.field = field
        self.written = 0
        self.skipped = 0

    def __call__(self, df: Any, batch_id: int) -> None:
        import redis

        from ..sinks import SinkError
        from ..sinks.redis import BATCH_LUA

        batch_id = _check_batch_id(batch_id)
        if self.field is not None and self.field not in df.columns:
            raise SinkError(f"field={self.field!r} is not a column of the batch ({df.columns})")
        values: list[str] = []
        for r in _rows(df):
            record = r.asDict(recursive=True)
            if self.field is not None:
                values.append(str(record[self.field]))
            values.append(json.dumps(record, separators=(",", ":"), default=str, ensure_ascii=False))
        with redis.Redis.from_url(self.url) as client:
            script = client.register_script(BATCH_LUA)
            try:
                applied = script(
                    keys=[self.key, self.frontier_key],
                    args=[batch_id, _query_id(df), "list" if self.field is None else "hash", *values],
                )
            except redis.ResponseError as exc:
                raise SinkError(f"sink {self.name!r}, batch {batch_id}: {exc}") from exc
        if applied:
            self.written += 1
        else:
            log.info("sink %s: batch %d already committed; skipped", self.name, batch_id)
            self.skipped += 1


def _rows(df: Any) -> Iterator[Any]:
    rows: Iterator[Any] = df.toLocalIterator()
    return rows


def postgres_sink(conninfo: str, table: str, *, name: str, columns: Sequence[str] | None = None) -> PostgresBatchSink:
    """A ``foreachBatch`` function writing each micro-batch into ``table`` (``columns``, default:
    the DataFrame's, in its order) together with its batch id, in one transaction; a replayed batch
    id adds nothing. The table must exist."""
    return PostgresBatchSink(conninfo, table, name=name, columns=columns)


def redis_sink(url: str, *, name: str, key: str | None = None, field: str | None = None) -> RedisBatchSink:
    """A ``foreachBatch`` function writing each micro-batch's rows as JSON to the list ``key``
    (default ``onceflow:{<name>}:out``), or with ``field=<column>`` to the hash ``key`` under that
    column's value, together with its batch id, in one Lua script; a replayed batch id adds nothing."""
    return RedisBatchSink(url, name=name, key=key, field=field)
