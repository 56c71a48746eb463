"""``onceflow bench spark``: rows/s through Spark, onceflow source → onceflow exactly-once sink,
beside an in-memory Python data source → no-op Python sink of the same shape, in the same run.

Both pipelines run on the same local[N] session as Structured Streaming queries with
``Trigger.AvailableNow`` and the same ``maxRecordsPerTrigger``; throughput is rows over the sum of
the micro-batches' trigger times (Spark's own progress reports), so session start-up is left out.
The fixed cost of a micro-batch is the median trigger time of one-row batches through onceflow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from onceflow.spark.source import source_schema
from onceflow.testing import onceflow_server

from .append import report
from .progress import say

__all__ = ["run"]

ROW = '{"id":%d,"user":"user-%02d","amount":%d.25,"note":"abcdefghijklmnopqrstuvwxyz0123456789"}'  # ~100 B


def _say(msg: str) -> None:
    say(msg, prefix="[bench spark]", stream=sys.stderr)


class _Slice(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        super().__init__((start, end))
        self.start, self.end = start, end


class MemoryReader(DataSourceStreamReader):
    """``total`` rows shaped like the onceflow source's, made in memory, as Arrow batches."""

    def __init__(self, total: int, per_partition: int) -> None:
        self.total, self.per_partition = total, per_partition

    def initialOffset(self) -> dict[str, int]:
        return {"n": 0}

    def latestOffset(self, start: dict[str, int], limit: Any = None) -> dict[str, int]:
        from pyspark.sql.streaming.datasource import ReadMaxRows

        end = self.total
        if isinstance(limit, ReadMaxRows):
            end = min(end, start["n"] + limit.max_rows)
        return {"n": end}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        return [
            _Slice(a, min(a + self.per_partition, end["n"])) for a in range(start["n"], end["n"], self.per_partition)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Slice)
        from onceflow.spark.source import arrow_schema

        step = 20_000
        for a in range(partition.start, partition.end, step):
            b = min(a + step, partition.end)
            n = b - a
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array(["bench/in"] * n, pa.string()),
                    pa.array(range(a, b), pa.int64()),
                    pa.array([1_700_000_000_000_000] * n, pa.timestamp("us", tz="UTC")),
                    pa.array([ROW % (i, i % 40, i % 100) for i in range(a, b)], pa.string()),
                    pa.array(["application/json"] * n, pa.string()),
                ],
                schema=arrow_schema(text_values=True),
            )


class NoopWriter(DataSourceStreamArrowWriter):
    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        for rb in iterator:
            rb.column(0).to_pylist()  # touch the values, as a real sink would
        return WriterCommitMessage()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        pass


class MemoryDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "onceflow-bench-memory"

    def schema(self) -> StructType:
        return source_schema(True)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # noqa: N802
        return MemoryReader(int(self.options["rows"]), int(self.options["perPartition"]))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802
        return NoopWriter()


def _rate(query: Any) -> tuple[int, float, list[float]]:
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    rows = sum(int(p["numInputRows"]) for p in progress)
    ms = [float(p["durationMs"]["triggerExecution"]) for p in progress]
    return rows, sum(ms) / 1000, ms


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from onceflow.client import IdempotentProducer
    from onceflow.spark import register
    from onceflow.spark.pipeline import session

    work = Path(tempfile.mkdtemp(prefix="onceflow-bench-spark-"))
    server = onceflow_server(work / "data")
    server.start()
    try:
        import httpx

        httpx.put(f"{server.url}/v1/stream/bench/in", headers={"content-type": "application/json"}).raise_for_status()
        _say(f"writing {args.rows:,} rows of ~100 B to bench/in")
        t0 = time.perf_counter()
        with IdempotentProducer(server.url, "bench/in", linger_ms=5) as producer:
            step = 10_000
            for a in range(0, args.rows, step):
                producer.extend([json.loads(ROW % (i, i % 40, i % 100)) for i in range(a, min(a + step, args.rows))])
        _say(f"  {args.rows / (time.perf_counter() - t0):,.0f} rows/s with the idempotent producer")

        spark = session(app="onceflow-bench-spark", cores=args.cores)
        register(spark)
        spark.dataSource.register(MemoryDataSource)
        results: dict[str, Any] = {
            "rows": args.rows,
            "cores": args.cores,
            "max_records_per_trigger": args.max_records_per_trigger,
        }
        best: dict[str, float] = {}
        for attempt in range(args.repeat):
            for side in ("memory", "onceflow"):
                ckpt = work / f"ckpt-{side}-{attempt}"
                if side == "onceflow":
                    src = (
                        spark.readStream.format("onceflow")
                        .option("url", server.url)
                        .option("streams", "bench/in")
                        .option("maxRecordsPerTrigger", str(args.max_records_per_trigger))
                        .option("maxRecordsPerPartition", str(args.per_partition))
                        .load()
                    )
                    q = (
                        src.selectExpr("value")
                        .writeStream.format("onceflow")
                        .option("url", server.url)
                        .option("stream", f"bench/out-{attempt}")
                        .option("sinkId", f"bench-{attempt}")
                        .option("checkpointLocation", str(ckpt))
                        .trigger(availableNow=True)
                        .start()
                    )
                else:
                    src = (
                        spark.readStream.format("onceflow-bench-memory")
                        .option("rows", str(args.rows))
                        .option("perPartition", str(args.per_partition))
                        .option("maxRecordsPerTrigger", str(args.max_records_per_trigger))
                        .load()
                    )
                    q = (
                        src.selectExpr("value")
                        .writeStream.format("onceflow-bench-memory")
                        .option("checkpointLocation", str(ckpt))
                        .trigger(availableNow=True)
                        .start()
                    )
                q.awaitTermination()
                rows, seconds, _ = _rate(q)
                rate = rows / seconds if seconds else 0.0
                _say(
                    f"  run {attempt + 1}: {side:8s} {rows:,} rows in {seconds:.2f} s of micro-batches: {rate:,.0f} rows/s"
                )
                if rows != args.rows:
                    _say(f"  warning: {side} saw {rows:,} rows, expected {args.rows:,}")
                best[side] = max(best.get(side, 0.0), rate)

        # fixed cost of a micro-batch: one-row batches through onceflow
        httpx.put(f"{server.url}/v1/stream/bench/tiny", headers={"content-type": "application/json"}).raise_for_status()
        for i in range(args.tiny_batches):
            httpx.post(f"{server.url}/v1/stream/bench/tiny", json=[{"i": i}]).raise_for_status()
        q = (
            spark.readStream.format("onceflow")
            .option("url", server.url)
            .option("streams", "bench/tiny")
            .option("maxRecordsPerTrigger", "1")
            .load()
            .selectExpr("value")
            .writeStream.format("onceflow")
            .option("url", server.url)
            .option("stream", "bench/tiny-out")
            .option("sinkId", "bench-tiny")
            .option("checkpointLocation", str(work / "ckpt-tiny"))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination()
        _, _, tiny_ms = _rate(q)
        spark.stop()
    finally:
        server.stop()

    ratio = best["onceflow"] / best["memory"] if best.get("memory") else 0.0
    batch_ms = statistics.median(tiny_ms) if tiny_ms else float("nan")
    results.update(
        {
            "onceflow_rows_per_s": best["onceflow"],
            "memory_rows_per_s": best["memory"],
            "ratio": ratio,
            "micro_batch_fixed_ms_p50": batch_ms,
            "micro_batch_fixed_ms": tiny_ms,
        }
    )
    text = "\n".join(
        [
            f"onceflow bench spark: local[{args.cores}], {args.rows:,} rows of ~100 B, maxRecordsPerTrigger {args.max_records_per_trigger:,}, best of {args.repeat}",
            "",
            "| pipeline | rows/s |",
            "|---|---:|",
            f"| onceflow source → onceflow exactly-once sink | {best['onceflow']:,.0f} |",
            f"| in-memory Python source → no-op Python sink | {best['memory']:,.0f} |",
            f"| ratio | {ratio:.2f}x |",
            "",
            f"fixed cost of a micro-batch (one row, onceflow → onceflow): p50 {batch_ms:.0f} ms over {len(tiny_ms)} batches",
        ]
    )
    failures = []
    if ratio < 0.8:
        failures.append(f"onceflow pipeline is {ratio:.2f}x the in-memory one (target >= 0.8x)")
    if best["onceflow"] < 150_000:
        failures.append(f"onceflow pipeline did {best['onceflow']:,.0f} rows/s (target >= 150,000)")
    return report(text, results, failures, args.out)
