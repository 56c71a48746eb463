"""The demo pipeline: a Spark driver that reads onceflow and writes onceflow, exactly once.

Run as ``python -m onceflow.spark.pipeline --url URL --checkpoint DIR``. It runs two Structured
Streaming queries over the stream ``<prefix>events`` (JSON events ``{"id", "user", "amount"}``):

- **enrich**: each event with a ``tier`` field added, to ``<prefix>enriched``;
- **counts**: running per-user counts and sums (a stateful aggregation in update mode), to
  ``<prefix>counts``; the last record of each user holds its totals.

It stops when ``--stop-file`` appears. ``onceflow demo`` and the fault tests start it, kill -9 it and
start it again from its checkpoint. They can make it kill itself at the worst moments:
``--crash-after-commit N`` (the sink committed batch N, Spark has not written its commit log yet)
and ``--crash-in-write N`` (a task wrote its rows inside its open transaction; nothing committed).
The process kills its whole process group, the JVM included, as a crash would.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from .datasource import OnceflowDataSource
from .writer import OnceflowStreamWriter, TaskCommit

__all__ = ["main"]


def _crash(why: str) -> None:
    # Spark's Python workers do not share the driver's stderr: note the crash in a file as well
    line = f"pipeline: crashing on purpose: {why}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    note = os.environ.get("ONCEFLOW_PIPELINE_CRASH_LOG")
    if note:
        with open(note, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    pgid = int(os.environ.get("ONCEFLOW_PIPELINE_PGID", "0"))
    if pgid > 0:
        os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingWriter(OnceflowStreamWriter):
    """The exactly-once sink, plus crashes at chosen points (for the demo and the fault tests)."""

    crash_after_commit: int | None = None
    crash_in_write: int | None = None

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TaskCommit:
        result = super().write(iterator)
        from pyspark import TaskContext

        ctx = TaskContext.get()
        raw = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
        batch = int(raw) if raw is not None else -1
        if (
            self.crash_in_write is not None
            and batch == self.crash_in_write
            and not result.skipped
            and result.txn is not None
        ):
            _crash(
                f"inside write() of batch {batch}: {result.rows} rows written in transaction {result.transactional_id}, not committed"
            )
        return result

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        super().commit(messages, batchId)
        if self.crash_after_commit is not None and batchId == self.crash_after_commit:
            _crash(f"after the sink committed batch {batchId}, before Spark's commit log")


class CrashingDataSource(OnceflowDataSource):
    """``format("onceflow")`` whose stream writer may crash (options ``crashAfterCommit``, ``crashInWrite``)."""

    extra_options = ("crashAfterCommit", "crashInWrite")

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802
        base = super().streamWriter(schema, overwrite)
        assert isinstance(base, OnceflowStreamWriter)
        writer = CrashingWriter(base.opts, base.sink_id)
        opts = {k.lower(): v for k, v in self.options.items()}
        if "crashaftercommit" in opts:
            writer.crash_after_commit = int(opts["crashaftercommit"])
        if "crashinwrite" in opts:
            writer.crash_in_write = int(opts["crashinwrite"])
        return writer


def session(app: str = "onceflow-pipeline", cores: int = 2) -> Any:
    """A local Spark session set up the way onceflow runs it (loopback only, quiet)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(cores))
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.execution.pythonUDF.arrow.enabled", "false")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def start_queries(spark: Any, args: argparse.Namespace) -> list[Any]:
    from pyspark.sql import functions as F

    spark.dataSource.register(CrashingDataSource)
    events = (
        spark.readStream.format("onceflow")
        .option("url", args.url)
        .option("streams", f"{args.prefix}events")
        .option("maxRecordsPerTrigger", str(args.max_records_per_trigger))
        .load()
        .select(F.from_json("value", "id LONG, user STRING, amount DOUBLE").alias("e"), "offset")
        .select("e.*", "offset")
    )
    crash = {}
    if args.crash_after_commit is not None:
        crash["crashAfterCommit"] = str(args.crash_after_commit)
    if args.crash_in_write is not None:
        crash["crashInWrite"] = str(args.crash_in_write)
    enriched = events.select(
        F.to_json(
            F.struct(
                "id",
                "user",
                "amount",
                F.when(F.col("amount") >= 50, "big").otherwise("small").alias("tier"),
                F.col("offset").alias("source_offset"),
            )
        ).alias("value")
    )
    q1 = (
        enriched.writeStream.format("onceflow")
        .option("url", args.url)
        .option("stream", f"{args.prefix}enriched")
        .option("sinkId", f"{args.sink_prefix}enrich")
        .options(**crash)
        .option("checkpointLocation", str(Path(args.checkpoint) / "enrich"))
        .queryName("enrich")
        .start()
    )
    counts = events.groupBy("user").agg(F.count("*").alias("events"), F.sum("amount").alias("amount"))

    def write_counts(df: Any, batch_id: int) -> None:
        # update mode is not open to Python sinks; foreachBatch + a batch write keyed by batch id is
        (
            df.select(F.to_json(F.struct("user", "events", "amount")).alias("value"))
            .write.format("onceflow")
            .option("url", args.url)
            .option("stream", f"{args.prefix}counts")
            .option("sinkId", f"{args.sink_prefix}counts")
            .option("batchId", str(batch_id))
            .mode("append")
            .save()
        )

    q2 = (
        counts.writeStream.outputMode("update")
        .foreachBatch(write_counts)
        .option("checkpointLocation", str(Path(args.checkpoint) / "counts"))
        .queryName("counts")
        .start()
    )
    return [q1, q2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onceflow.spark.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prefix", default="demo/", help="stream name prefix (default: demo/)")
    p.add_argument("--sink-prefix", default="demo-", help="sink id prefix (default: demo-)")
    p.add_argument("--stop-file", type=Path, help="stop cleanly when this file appears")
    p.add_argument("--max-records-per-trigger", type=int, default=2000)
    p.add_argument("--crash-after-commit", type=int, metavar="BATCH")
    p.add_argument("--crash-in-write", type=int, metavar="BATCH")
    p.add_argument("--cores", type=int, default=2)
    args = p.parse_args(argv)
    os.environ["ONCEFLOW_PIPELINE_PGID"] = str(os.getpgrp()) if os.getpgrp() == os.getpid() else "0"
    Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
    os.environ["ONCEFLOW_PIPELINE_CRASH_LOG"] = str(Path(args.checkpoint) / "crashes.log")
    spark = session(cores=args.cores)
    queries = start_queries(spark, args)
    print("pipeline: running", flush=True)
    try:
        while all(q.isActive for q in queries):
            if args.stop_file is not None and args.stop_file.exists():
                break
            time.sleep(0.2)
        for q in queries:
            if q.exception() is not None:
                print(f"pipeline: query {q.name} failed: {q.exception()}", file=sys.stderr, flush=True)
                return 1
    finally:
        for q in queries:
            q.stop()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
