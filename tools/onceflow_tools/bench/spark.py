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
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
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


class MemoryReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``total`` rows shaped like the onceflow source's, made in memory, as Arrow batches; at most
    ``max_rows`` per micro-batch, as the onceflow source with ``maxRecordsPerTrigger``."""

    def __init__(self, total: int, per_partition: int, max_rows: int | None = None) -> None:
        self.total, self.per_partition, self.max_rows = total, per_partition, max_rows

    def initialOffset(self) -> dict[str, int]:
        return {"n": 0}

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 (Spark's name)
        # as the onceflow source: without this and SupportsTriggerAvailableNow Spark passes
        # ReadAllAvailable, and the whole input is one micro-batch (one fixed cost, not one per batch)
        return ReadMaxRows(self.max_rows) if self.max_rows else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 (Spark's name)
        pass  # the input is fixed: ``total`` rows

    def latestOffset(self, start: dict[str, int], limit: Any = None) -> dict[str, int]:
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
        limit = self.options.get("maxRecordsPerTrigger")
        return MemoryReader(int(self.options["rows"]), int(self.options["perPartition"]), int(limit) if limit else None)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802
        return NoopWriter()


def _rate(query: Any) -> tuple[int, float, list[float]]:
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    rows = sum(int(p["numInputRows"]) for p in progress)
    ms = [float(p["durationMs"]["triggerExecution"]) for p in progress]
    return rows, sum(ms) / 1000, ms


# Spark's phases of a micro-batch (its progress reports' durationMs), in the order they run
PHASES = ("latestOffset", "walCommit", "queryPlanning", "getBatch", "addBatch", "commitOffsets", "triggerExecution")


def phases(query: Any) -> dict[str, float]:
    """The median of each phase over the query's micro-batches that had rows, in ms."""
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    if not progress:
        return {}
    return {k: statistics.median(float(p["durationMs"].get(k, 0)) for p in progress) for k in PHASES}


def run_pipeline(
    spark: Any,
    side: str,
    *,
    url: str,
    stream: str,
    rows: int,
    out: str,
    checkpoint: Path,
    max_records: int,
    per_partition: int,
) -> Any:
    """Run one pipeline to the end of its input (``Trigger.AvailableNow``); the ended query.

    ``onceflow``: ``stream`` on the server at ``url`` → the exactly-once sink into ``out``.
    ``memory``: ``rows`` made in memory → the no-op sink. Both select the value column only and
    take at most ``max_records`` rows per micro-batch, ``per_partition`` per Spark partition.
    """
    if side == "onceflow":
        src = (
            spark.readStream.format("onceflow")
            .option("url", url)
            .option("streams", stream)
            .option("maxRecordsPerTrigger", str(max_records))
            .option("maxRecordsPerPartition", str(per_partition))
            .load()
        )
        writer = (
            src.selectExpr("value")
            .writeStream.format("onceflow")
            .option("url", url)
            .option("stream", out)
            .option("sinkId", out.replace("/", "-"))
        )
    elif side == "memory":
        src = (
            spark.readStream.format("onceflow-bench-memory")
            .option("rows", str(rows))
            .option("perPartition", str(per_partition))
            .option("maxRecordsPerTrigger", str(max_records))
            .load()
        )
        writer = src.selectExpr("value").writeStream.format("onceflow-bench-memory")
    else:
        raise ValueError(f"no pipeline {side!r}: onceflow or memory")
    q = writer.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    q.awaitTermination()
    return q


def machine_cpu() -> float:
    """CPU seconds the machine has spent busy (all cores, all processes) since boot: /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _phase_table(title: str, rows: dict[str, dict[str, float]]) -> list[str]:
    sides = list(rows)
    lines = [title, "", "| phase (Spark's durationMs) | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
    for k in PHASES:
        lines.append(f"| {k} | " + " | ".join(f"{rows[s].get(k, float('nan')):,.0f}" for s in sides) + " |")
    return lines


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
        big: dict[str, dict[str, float]] = {}
        cpu: dict[str, tuple[float, float]] = {}  # per side, of its best run: machine and server CPU us per row
        assert server.proc is not None
        for attempt in range(args.repeat):
            for side in ("memory", "onceflow"):
                machine0, server0 = machine_cpu(), process_cpu(server.proc.pid)
                q = run_pipeline(
                    spark,
                    side,
                    url=server.url,
                    stream="bench/in",
                    rows=args.rows,
                    out=f"bench/out-{attempt}",
                    checkpoint=work / f"ckpt-{side}-{attempt}",
                    max_records=args.max_records_per_trigger,
                    per_partition=args.per_partition,
                )
                rows, seconds, ms = _rate(q)
                rate = rows / seconds if seconds else 0.0
                per_row = (
                    (machine_cpu() - machine0) / max(rows, 1) * 1e6,
                    (process_cpu(server.proc.pid) - server0) / max(rows, 1) * 1e6,
                )
                _say(
                    f"  run {attempt + 1}: {side:8s} {rows:,} rows in {len(ms)} micro-batches, "
                    f"{seconds:.2f} s: {rate:,.0f} rows/s"
                )
                if rows != args.rows:
                    _say(f"  warning: {side} saw {rows:,} rows, expected {args.rows:,}")
                if rate > best.get(side, 0.0):
                    best[side], big[side], cpu[side] = rate, phases(q), per_row

        # the fixed cost of a micro-batch: one-row batches through each pipeline
        httpx.put(f"{server.url}/v1/stream/bench/tiny", headers={"content-type": "application/json"}).raise_for_status()
        for i in range(args.tiny_batches):
            httpx.post(f"{server.url}/v1/stream/bench/tiny", json=[{"i": i}]).raise_for_status()
        tiny: dict[str, dict[str, float]] = {}
        tiny_ms: list[float] = []
        for side in ("memory", "onceflow"):
            q = run_pipeline(
                spark,
                side,
                url=server.url,
                stream="bench/tiny",
                rows=args.tiny_batches,
                out="bench/tiny-out",
                checkpoint=work / f"ckpt-tiny-{side}",
                max_records=1,
                per_partition=1,
            )
            tiny[side] = phases(q)
            if side == "onceflow":
                tiny_ms = _rate(q)[2]
            _say(f"  one-row micro-batches, {side}: p50 {tiny[side].get('triggerExecution', float('nan')):,.0f} ms")
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
            "phases_ms_p50": {"batches": big, "one_row": tiny},
            "cpu_us_per_row": {side: {"machine": m, "server": v} for side, (m, v) in cpu.items()},
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
            "",
            "CPU per row over each best run, query start and stop included (every process on the machine:"
            f" Spark's JVM, its Python workers, the onceflow server): onceflow {cpu['onceflow'][0]:.2f} us,"
            f" in-memory {cpu['memory'][0]:.2f} us; {cpu['onceflow'][0] - cpu['memory'][0]:.2f} us more, of"
            f" which the server (receiving, checking, storing durably and serving each row) {cpu['onceflow'][1]:.2f} us.",
            "",
            *_phase_table(f"Where a micro-batch of {args.max_records_per_trigger:,} rows goes (p50 ms, best run)", big),
            "",
            *_phase_table("Where a one-row micro-batch goes (p50 ms)", tiny),
        ]
    )
    failures = []
    if ratio < 0.8:
        failures.append(f"onceflow pipeline is {ratio:.2f}x the in-memory one (target >= 0.8x)")
    if best["onceflow"] < 150_000:
        failures.append(f"onceflow pipeline did {best['onceflow']:,.0f} rows/s (target >= 150,000)")
    return report(text, results, failures, args.out)
