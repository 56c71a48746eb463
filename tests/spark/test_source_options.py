"""The source's options at the level of Spark's Kafka source (issue 32, item 4), each on a real local
Spark session against a real onceflow server: limits that count the rows Spark gets (an append of
many JSON messages is cut where a limit falls), a minimum per trigger that Trigger.AvailableNow never
waits for, a start by time, more partitions, Kafka's spellings, and an unknown option refused."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess
from helpers.spark import read_all

pytestmark = pytest.mark.slow
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = ServerProcess(tmp_path_factory.mktemp("spark-options") / "data")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()


def create(url: str, name: str) -> None:
    r = httpx.put(f"{url}/v1/stream/{name}", headers=JSON)
    assert r.status_code == 201, r.text


def append(url: str, name: str, messages: list[Any]) -> str:
    """One append of ``messages`` (one batch of the log); the stream's next offset after it."""
    r = httpx.post(f"{url}/v1/stream/{name}", content=json.dumps(messages), headers=JSON)
    assert r.status_code in (200, 204), r.text
    return r.headers["stream-next-offset"]


def run_available_now(registered: Any, url: str, stream: str, ckpt: Path, **options: str) -> tuple[Any, list[int]]:
    """Stream ``stream`` into the onceflow stream ``<stream>-out`` with Trigger.AvailableNow; the
    query and the rows of each micro-batch that read any."""
    reader = registered.readStream.format("onceflow").option("url", url).option("streams", stream)
    for k, v in options.items():
        reader = reader.option(k, v)
    q = (
        reader.load()
        .selectExpr("value")
        .writeStream.format("onceflow")
        .option("url", url)
        .option("stream", f"{stream}-out")
        .option("sinkId", stream.replace("/", "-"))
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    return q, [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]


def test_a_per_trigger_limit_counts_rows_even_inside_one_append(registered: Any, url: str, tmp_path: Path) -> None:
    """One append of 30 JSON messages with maxRecordsPerTrigger 10 made one micro-batch of 30: the
    limit counted appends. Now the micro-batches hold 10 rows each, Kafka's maxOffsetsPerTrigger is
    the same limit, and a replay of a batch that ends inside the append reads the same rows."""
    create(url, "rows/in")
    append(url, "rows/in", [{"id": i} for i in range(30)])
    append(url, "rows/in", [{"id": i} for i in range(30, 35)])
    q, sizes = run_available_now(registered, url, "rows/in", tmp_path / "c1", maxRecordsPerTrigger="10")
    assert sizes == [10, 10, 10, 5]
    assert [m["id"] for m in read_all(url, "rows/in-out")] == list(range(35))
    # Spark crashed after the sink committed the last batch but before its commit log: the batch is
    # run again from the offsets logged, which end inside the first append
    ckpt = tmp_path / "c1"
    last = max(int(p.name) for p in (ckpt / "commits").iterdir() if p.name.isdigit())
    (ckpt / "commits" / str(last)).unlink()
    (ckpt / "commits" / f".{last}.crc").unlink(missing_ok=True)
    run_available_now(registered, url, "rows/in", ckpt, maxRecordsPerTrigger="10")
    assert [m["id"] for m in read_all(url, "rows/in-out")] == list(range(35))  # nothing doubled

    create(url, "rows/kafka")
    append(url, "rows/kafka", [{"id": i} for i in range(25)])
    _, sizes = run_available_now(registered, url, "rows/kafka", tmp_path / "c2", maxOffsetsPerTrigger="10")
    assert sizes == [10, 10, 5]
    assert [m["id"] for m in read_all(url, "rows/kafka-out")] == list(range(25))


def test_max_bytes_per_trigger_bounds_the_bytes_a_micro_batch_reads(registered: Any, url: str, tmp_path: Path) -> None:
    """Messages of about 100 stored bytes each, in appends of 20, and maxBytesPerTrigger 1000: about
    ten rows a micro-batch, never the whole append."""
    create(url, "bytes/in")
    for a in range(3):
        append(url, "bytes/in", [{"id": 20 * a + i, "pad": "x" * 80} for i in range(20)])
    _, sizes = run_available_now(registered, url, "bytes/in", tmp_path / "c", maxBytesPerTrigger="1000")
    assert sum(sizes) == 60 and len(sizes) >= 6
    assert max(sizes) <= 10  # each row is at least 90 bytes of the log
    assert sorted(m["id"] for m in read_all(url, "bytes/in-out")) == list(range(60))


def test_min_offsets_per_trigger_never_holds_available_now_back(registered: Any, url: str, tmp_path: Path) -> None:
    """Trigger.AvailableNow with minOffsetsPerTrigger above what is there reads what is there and
    stops (Spark's ReadMinRows would otherwise wait for rows that may never come)."""
    create(url, "min/now")
    append(url, "min/now", [{"id": i} for i in range(20)])
    _, sizes = run_available_now(
        registered, url, "min/now", tmp_path / "c", minOffsetsPerTrigger="50", maxTriggerDelay="1h"
    )
    assert sizes == [20]


def test_min_offsets_per_trigger_waits_for_rows_or_for_max_trigger_delay(url: str) -> None:
    """The reader's decision, on a clock the test moves: below minOffsetsPerTrigger no micro-batch
    until maxTriggerDelay passed since the last one; at the minimum one at once."""
    from pyspark.sql.streaming.datasource import ReadMinRows

    from onceflow.spark.options import Options
    from onceflow.spark.source import OnceflowStreamReader

    create(url, "min/held")
    append(url, "min/held", [{"id": i} for i in range(20)])
    opts = Options.parse(
        {"url": url, "streams": "min/held", "minOffsetsPerTrigger": "30", "maxTriggerDelay": "2m"}, "source"
    )
    reader = OnceflowStreamReader(opts, text_values=True)
    now = [1000.0]
    reader.clock = lambda: now[0]
    reader.last_batch = now[0]
    try:
        start = reader.initialOffset()
        limit = reader.getDefaultReadLimit()
        assert limit == ReadMinRows(30)
        assert reader.latestOffset(start, limit) == start  # 20 rows wait: held back
        now[0] += 119
        assert reader.latestOffset(start, limit) == start
        now[0] += 1  # 2 minutes since the last micro-batch: what is there goes
        first = reader.latestOffset(start, limit)
        assert first != start
        tail = append(url, "min/held", [{"id": i} for i in range(20, 30)])
        assert reader.latestOffset(first, limit) == first  # 10 rows, the delay starts again
        append(url, "min/held", [{"id": i} for i in range(30, 50)])
        assert reader.latestOffset(first, limit) != first  # 30 rows: at once
        assert tail != first
    finally:
        reader.stop()


def test_starting_timestamp_starts_each_stream_at_its_first_record_then(
    registered: Any, url: str, tmp_path: Path
) -> None:
    """startingTimestamp (every stream) and startingOffsetsByTimestamp (per stream): the first
    record appended at or after that time, looked up by the server; a stream with nothing that
    late starts at its end."""
    create(url, "time/a")
    create(url, "time/b")
    append(url, "time/a", [{"id": i} for i in range(5)])
    append(url, "time/b", [{"id": 100 + i} for i in range(5)])
    time.sleep(0.01)  # append times are in milliseconds: the next appends are stamped later
    append(url, "time/a", [{"id": i} for i in range(5, 8)])
    whole = registered.read.format("onceflow").option("url", url).option("streams", "time/a").load()
    stamps = sorted({r.timestamp for r in whole.select("timestamp").collect()})
    assert len(stamps) == 2
    later = int(stamps[1].timestamp() * 1000)

    def ids(df: Any) -> list[int]:
        return sorted(json.loads(r.value)["id"] for r in df.select("value").collect())

    def read(**options: str) -> Any:
        reader = registered.read.format("onceflow").option("url", url).option("streams", "time/a,time/b")
        for k, v in options.items():
            reader = reader.option(k, v)  # (a DataFrameReader keeps its options: a new one each time)
        return reader.load()

    assert ids(read(startingTimestamp=str(later))) == [5, 6, 7]  # time/b: nothing that late, from its end
    by_stream = read(startingOffsetsByTimestamp=json.dumps({"time/a": later}))
    assert ids(by_stream) == [5, 6, 7, *range(100, 105)]  # time/b from startingOffsets (earliest)
    # a streaming query starts there too
    q = (
        registered.readStream.format("onceflow")
        .option("url", url)
        .option("streams", "time/a")
        .option("startingTimestamp", str(later))
        .load()
        .writeStream.format("memory")
        .queryName("time_a")
        .option("checkpointLocation", str(tmp_path / "c"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    assert ids(registered.table("time_a")) == [5, 6, 7]
    with pytest.raises(Exception, match="startingOffsetsByTimestamp must be a JSON object"):
        read(startingOffsetsByTimestamp='{"time/a": "yesterday"}').collect()


def test_min_partitions_splits_even_one_append(registered: Any, url: str) -> None:
    """minPartitions 3 over one append of 30 messages: three tasks of 10 rows, each row once."""
    create(url, "parts/in")
    append(url, "parts/in", [{"id": i} for i in range(30)])
    df = (
        registered.read.format("onceflow")
        .option("url", url)
        .option("streams", "parts/in")
        .option("minPartitions", "3")
        .load()
    )
    assert df.rdd.getNumPartitions() == 3
    per_task = df.select("offset").rdd.glom().map(len).collect()
    assert per_task == [10, 10, 10]
    assert sorted(r.offset for r in df.select("offset").collect()) == list(range(30))


def test_the_progress_shows_how_far_behind_the_latest_offset_a_batch_is(
    registered: Any, url: str, tmp_path: Path
) -> None:
    """Each micro-batch's progress holds the source's latestOffset (each stream's end when it was
    planned) beside its endOffset: the distance is how far behind the query is."""
    from onceflow.spark.source import Cut

    create(url, "lag/in")
    end = append(url, "lag/in", [{"id": i} for i in range(30)])
    q, _ = run_available_now(registered, url, "lag/in", tmp_path / "c", maxRecordsPerTrigger="10")
    progress = [p["sources"][0] for p in q.recentProgress if p["numInputRows"]]
    assert [json.loads(p["latestOffset"]) for p in progress] == [{"lag/in": end}] * 3
    behind = [30 - Cut.parse(json.loads(p["endOffset"])["lag/in"]).record for p in progress]
    assert behind == [20, 10, 0]


def test_kafkas_fail_on_data_loss_is_offset_reset() -> None:
    from onceflow.spark.options import OptionError, Options

    assert Options.parse({"failOnDataLoss": "false"}, "source").offset_reset == "earliest"
    assert Options.parse({"failondataloss": "TRUE"}, "source").offset_reset == "error"
    assert Options.parse({"failOnDataLoss": "false", "offsetReset": "earliest"}, "source").offset_reset == "earliest"
    with pytest.raises(OptionError, match="disagree"):
        Options.parse({"failOnDataLoss": "false", "offsetReset": "error"}, "source")
    with pytest.raises(OptionError, match="one limit under two names"):
        Options.parse({"maxOffsetsPerTrigger": "5", "maxRecordsPerTrigger": "6"}, "source")
    with pytest.raises(OptionError, match="maxTriggerDelay must be a duration"):
        Options.parse({"maxTriggerDelay": "soon"}, "source")
    assert Options.parse({"maxTriggerDelay": "90s"}, "source").max_trigger_delay_ms == 90_000


def test_an_unknown_option_is_refused_naming_the_closest_known_one(registered: Any, url: str, tmp_path: Path) -> None:
    """A misspelt limit was ignored and the query ran unbounded without a word; a source option
    given to the sink likewise. Names match in any case, as Spark's options do, and the options
    Spark itself hands the sink (checkpointLocation, queryName) are taken."""
    create(url, "unknown/in")
    append(url, "unknown/in", [{"id": i} for i in range(3)])

    def read() -> Any:  # a new DataStreamReader each time: one keeps every option given to it
        return registered.readStream.format("onceflow").option("url", url).option("streams", "unknown/in")

    with pytest.raises(
        Exception, match="unknown option maxrecordpertrigger for the onceflow source; did you mean maxRecordsPerTrigger"
    ):
        read().option("maxRecordPerTrigger", "10").load()
    with pytest.raises(Exception, match="takes no path"):
        registered.read.format("onceflow").option("url", url).load("unknown/in").collect()
    df = read().option("MAXRECORDSPERTRIGGER", "2").option("failOnDataLoss", "false").load()
    with pytest.raises(Exception, match="unknown option sinkidd for the onceflow sink; did you mean sinkId"):
        df.selectExpr("value").writeStream.format("onceflow").option("url", url).option("stream", "unknown/out").option(
            "sinkIdd", "u"
        ).option("checkpointLocation", str(tmp_path / "c1")).start().awaitTermination()
    with pytest.raises(Exception, match="option streams is an option of the source, not the sink"):
        df.selectExpr("value").writeStream.format("onceflow").option("url", url).option(
            "streams", "unknown/out"
        ).option("sinkId", "u").option("checkpointLocation", str(tmp_path / "c2")).start().awaitTermination()
    q = (
        df.selectExpr("value")
        .writeStream.format("onceflow")
        .option("url", url)
        .option("stream", "unknown/out")
        .option("SinkID", "u")
        .option("checkpointLocation", str(tmp_path / "c3"))
        .queryName("unknown_ok")
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == [2, 1]
    assert len(read_all(url, "unknown/out")) == 3


def test_the_demos_crash_points_are_options_of_its_data_source() -> None:
    """The demo's data source takes its crash points besides the connector's options."""
    from onceflow.spark.options import OptionError, Options
    from onceflow.spark.pipeline import CrashingDataSource

    raw = {"url": "http://127.0.0.1:1", "stream": "out", "sinkId": "s", "crashinwrite": "3"}
    assert Options.parse(raw, "sink", CrashingDataSource.extra_options).sink_id == "s"
    with pytest.raises(OptionError, match="unknown option crashinwrite"):
        Options.parse(raw, "sink")
