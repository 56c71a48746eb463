"""The Spark connector in a real local[2] session against a real onceflow server."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.relay import FreezableRelay
from helpers.servers import ServerProcess
from helpers.spark import read_all

pytestmark = pytest.mark.slow
JSON = {"content-type": "application/json"}


def put(url: str, name: str, content_type: str = "application/json") -> None:
    r = httpx.put(f"{url}/v1/stream/{name}", headers={"content-type": content_type})
    assert r.status_code in (200, 201), r.text


def post(url: str, name: str, body: Any, content_type: str = "application/json") -> None:
    data = json.dumps(body) if content_type == "application/json" else body
    r = httpx.post(f"{url}/v1/stream/{name}", content=data, headers={"content-type": content_type})
    assert r.status_code in (200, 204), r.text


def head(url: str, name: str) -> httpx.Response:
    return httpx.head(f"{url}/v1/stream/{name}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = ServerProcess(tmp_path_factory.mktemp("spark") / "data")
    s.start()
    yield s
    s.kill()


def seed(url: str, name: str, n: int, per_append: int = 25) -> list[dict[str, int]]:
    put(url, name)
    rows = [{"id": i, "key": i % 7} for i in range(n)]
    for i in range(0, n, per_append):
        post(url, name, rows[i : i + per_append])
    return rows


def test_batch_read_gives_one_row_per_message_with_offsets(registered: Any, srv: ServerProcess) -> None:
    from pyspark.sql import functions as F

    rows = seed(srv.url, "read/json", 120)
    df = registered.read.format("onceflow").option("url", srv.url).option("streams", "read/json").load()
    assert [f.name for f in df.schema.fields] == ["stream", "offset", "timestamp", "value", "content_type"]
    assert df.schema["value"].dataType.simpleString() == "string"
    got = df.select("offset", F.from_json("value", "id INT, key INT").alias("v")).orderBy("offset").collect()
    assert [r.offset for r in got] == list(range(120))
    assert [{"id": r.v.id, "key": r.v.key} for r in got] == rows


def test_byte_streams_read_as_binary_one_row_per_append(registered: Any, srv: ServerProcess) -> None:
    put(srv.url, "read/bytes", "application/octet-stream")
    for chunk in (b"\x00\x01", b"abc", b"\xff" * 10):
        post(srv.url, "read/bytes", chunk, "application/octet-stream")
    df = registered.read.format("onceflow").option("url", srv.url).option("streams", "read/bytes").load()
    assert df.schema["value"].dataType.simpleString() == "binary"
    assert [bytes(r.value) for r in df.orderBy("offset").collect()] == [b"\x00\x01", b"abc", b"\xff" * 10]


def test_a_long_range_is_split_into_partitions_that_read_every_row_once(registered: Any, srv: ServerProcess) -> None:
    seed(srv.url, "read/split", 500, per_append=10)
    df = (
        registered.read.format("onceflow")
        .option("url", srv.url)
        .option("streams", "read/split")
        .option("maxRecordsPerPartition", "120")
        .load()
    )
    assert df.rdd.getNumPartitions() >= 4
    offsets = sorted(r.offset for r in df.select("offset").collect())
    assert offsets == list(range(500))


def test_pattern_reads_every_stream_under_a_prefix(registered: Any, srv: ServerProcess) -> None:
    for i in range(3):
        seed(srv.url, f"pat/{i}", 10)
    df = registered.read.format("onceflow").option("url", srv.url).option("pattern", "pat/").load()
    counts = {r["stream"]: r["count"] for r in df.groupBy("stream").count().collect()}
    assert counts == {"pat/0": 10, "pat/1": 10, "pat/2": 10}


def test_stream_to_stream_is_exactly_once_even_when_spark_replays_a_batch(
    registered: Any, srv: ServerProcess, tmp_path: Path
) -> None:
    rows = seed(srv.url, "eo/in", 300, per_append=20)
    ckpt = tmp_path / "ckpt"

    def run(limit: int = 100) -> Any:
        q = (
            registered.readStream.format("onceflow")
            .option("url", srv.url)
            .option("streams", "eo/in")
            .option("maxRecordsPerTrigger", str(limit))
            .load()
            .selectExpr("value")
            .writeStream.format("onceflow")
            .option("url", srv.url)
            .option("stream", "eo/out")
            .option("sinkId", "eo")
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination()
        return q

    q = run()
    batches = [p["batchId"] for p in q.recentProgress if p["numInputRows"]]
    assert len(batches) >= 3  # maxRecordsPerTrigger made several micro-batches
    assert sorted(r["id"] for r in read_all(srv.url, "eo/out")) == [r["id"] for r in rows]
    # Spark crashed after the sink committed the last batch but before its own commit log: it
    # re-runs that batch with the same offsets, even with another maxRecordsPerTrigger (suspicion
    # 4d, disproved for this case: the range comes from the offset log, so the replay's rows, and
    # their fingerprint, are the committed ones). The sink must add nothing.
    last = max(int(p.name) for p in (ckpt / "commits").iterdir() if p.name.isdigit())
    (ckpt / "commits" / str(last)).unlink()
    (ckpt / "commits" / f".{last}.crc").unlink(missing_ok=True)
    run(limit=37)
    out = read_all(srv.url, "eo/out")
    assert len(out) == 300 and sorted(r["id"] for r in out) == [r["id"] for r in rows]
    h = head(srv.url, "eo/out")
    assert h.headers["stream-last-stable-offset"] == h.headers["stream-next-offset"]  # no transaction left open
    sink = httpx.get(f"{srv.url}/v1/sinks/eo").json()
    assert sink["batch"] == last and sink["rows"] == 100  # the rows of the last batch, as the tasks counted


def test_source_reads_committed_data_only(registered: Any, srv: ServerProcess, tmp_path: Path) -> None:
    from onceflow.client import TransactionalProducer

    put(srv.url, "rc/in")
    post(srv.url, "rc/in", [{"n": 1}])
    with TransactionalProducer(srv.url, "rc-writer") as p:
        with p.transaction():
            p.append("rc/in", {"n": "aborted"})
            p.flush()
            p.abort()
        p.append("rc/in", {"n": "open"})  # left open: the source must stop before it
        p.flush()
        post(srv.url, "rc/in", [{"n": 2}])
        df = registered.read.format("onceflow").option("url", srv.url).option("streams", "rc/in").load()
        assert [json.loads(r.value) for r in df.orderBy("offset").collect()] == [{"n": 1}]
        unc = (
            registered.read.format("onceflow")
            .option("url", srv.url)
            .option("streams", "rc/in")
            .option("isolation", "read_uncommitted")
            .load()
        )
        assert [json.loads(r.value)["n"] for r in unc.orderBy("offset").collect()] == [1, "aborted", "open", 2]
        p.commit()
    df = registered.read.format("onceflow").option("url", srv.url).option("streams", "rc/in").load()
    assert [json.loads(r.value)["n"] for r in df.orderBy("offset").collect()] == [1, "open", 2]


def test_a_failed_task_leaves_nothing_visible_and_nothing_open(
    registered: Any, srv: ServerProcess, tmp_path: Path
) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    seed(srv.url, "fail/in", 200, per_append=10)

    def fail_on_last(value: str) -> str:
        if json.loads(value)["id"] == 199:
            time.sleep(3)  # let the other partition finish writing its rows first
            raise RuntimeError("injected task failure")
        return value

    explode_on_last = F.udf(fail_on_last, StringType(), useArrow=False)

    df = (
        registered.readStream.format("onceflow")
        .option("url", srv.url)
        .option("streams", "fail/in")
        .option("maxRecordsPerPartition", "100")
        .load()
        .select(explode_on_last("value").alias("value"))
    )
    q = (
        df.writeStream.format("onceflow")
        .option("url", srv.url)
        .option("stream", "fail/out")
        .option("sinkId", "fail")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(Exception, match="injected task failure"):
        q.awaitTermination()
    assert read_all(srv.url, "fail/out") == []
    # the partition that succeeded wrote its 100 rows inside a transaction; the batch's abort ended it
    assert len(read_all(srv.url, "fail/out", "read_uncommitted")) >= 100
    h = head(srv.url, "fail/out")
    assert h.headers["stream-last-stable-offset"] == h.headers["stream-next-offset"]


def test_a_stream_column_routes_rows_and_all_streams_commit_together(
    registered: Any, srv: ServerProcess, tmp_path: Path
) -> None:
    seed(srv.url, "route/in", 90, per_append=30)
    q = (
        registered.readStream.format("onceflow")
        .option("url", srv.url)
        .option("streams", "route/in")
        .load()
        .selectExpr("concat('route/out-', CAST(get_json_object(value, '$.key') % 3 AS STRING)) AS stream", "value")
        .writeStream.format("onceflow")
        .option("url", srv.url)
        .option("sinkId", "route")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    total = []
    for k in range(3):
        got = read_all(srv.url, f"route/out-{k}")
        assert got and all(r["key"] % 3 == k for r in got)
        total += got
    assert sorted(r["id"] for r in total) == list(range(90))


def test_batch_write_is_all_or_nothing(registered: Any, srv: ServerProcess) -> None:
    df = registered.createDataFrame([(json.dumps({"n": i}),) for i in range(50)], "value STRING").repartition(3)
    df.write.format("onceflow").option("url", srv.url).option("stream", "bw/out").mode("append").save()
    assert sorted(r["n"] for r in read_all(srv.url, "bw/out")) == list(range(50))


def test_the_compression_option_compresses_the_sinks_appends_and_the_sources_reads(
    registered: Any, srv: ServerProcess
) -> None:
    """Issue 32, item 2: ``compression`` sends the sink's appends in that coding and asks for the
    source's reads in it; a relay between Spark and the server shows the codings on the wire."""
    from onceflow.spark.options import OptionError, Options

    with pytest.raises(OptionError, match="option compression must be gzip or zstd"):
        Options.parse({"compression": "br"})
    relay = FreezableRelay(("127.0.0.1", srv.port), record=True)
    url = f"http://127.0.0.1:{relay.port}"
    try:
        rows = [(json.dumps({"n": i, "tag": f"row-{i % 9}"}),) for i in range(300)]
        df = registered.createDataFrame(rows, "value STRING").repartition(1)
        df.write.format("onceflow").option("url", url).option("stream", "cz/out").option("compression", "gzip").mode(
            "append"
        ).save()
        read = registered.read.format("onceflow").option("url", url).option("streams", "cz/out")
        got = read.option("compression", "zstd").load().collect()
    finally:
        relay.stop()
    assert sorted(json.loads(r.value)["n"] for r in got) == list(range(300))
    up, down = bytes(relay.heard["up"]).lower(), bytes(relay.heard["down"]).lower()
    assert b"\r\ncontent-encoding: gzip\r\n" in up and b"\r\naccept-encoding: zstd\r\n" in up
    assert b"\r\ncontent-encoding: zstd\r\n" in down


def test_misconfiguration_gets_a_message_that_says_what_to_do(
    registered: Any, srv: ServerProcess, tmp_path: Path
) -> None:
    seed(srv.url, "cfg/in", 5)
    with pytest.raises(Exception, match="exactly one of"):
        registered.read.format("onceflow").option("url", srv.url).load().collect()
    with pytest.raises(Exception, match="does not exist"):
        registered.read.format("onceflow").option("url", srv.url).option("streams", "cfg/missing").load().collect()
    src = registered.readStream.format("onceflow").option("url", srv.url).option("streams", "cfg/in").load()
    with pytest.raises(Exception, match="sinkId"):
        (
            src.selectExpr("value")
            .writeStream.format("onceflow")
            .option("url", srv.url)
            .option("stream", "cfg/out")
            .option("checkpointLocation", str(tmp_path / "c1"))
            .start()
            .awaitTermination(30)
        )
    with pytest.raises(Exception, match="column 'value'"):
        (
            src.selectExpr("offset")
            .writeStream.format("onceflow")
            .option("url", srv.url)
            .option("stream", "cfg/out")
            .option("sinkId", "cfg")
            .option("checkpointLocation", str(tmp_path / "c2"))
            .start()
            .awaitTermination(30)
        )
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_token_option_reads_and_writes_a_guarded_server(registered: Any, tmp_path: Path) -> None:
    cfg = tmp_path / "guard.json"
    # the streams and the sink id: the server itself hands out the ids of the sink's task transactions
    rw = ["read", "write"]
    cfg.write_text(json.dumps({"tokens": {"etl": [{"prefix": p, "scopes": rw} for p in ("sec/", "sec-out")]}}))
    guarded = ServerProcess(tmp_path / "data", "--guard", str(cfg))
    guarded.start()
    try:
        auth = {**JSON, "authorization": "Bearer etl"}
        assert httpx.put(f"{guarded.url}/v1/stream/sec/in", headers=auth).status_code == 201
        assert (
            httpx.post(
                f"{guarded.url}/v1/stream/sec/in", content=json.dumps([{"n": i} for i in range(20)]), headers=auth
            ).status_code
            == 204
        )
        reader = registered.read.format("onceflow").option("url", guarded.url).option("streams", "sec/in")
        with pytest.raises(Exception, match="401"):
            reader.load().collect()
        df = reader.option("token", "etl").load()
        assert df.count() == 20
        (
            df.select("value")
            .write.format("onceflow")
            .option("url", guarded.url)
            .option("token", "etl")
            .option("stream", "sec/out")
            .option("sinkId", "sec-out")
            .option("batchId", 0)
            .mode("append")
            .save()
        )
        r = httpx.get(f"{guarded.url}/v1/stream/sec/out", params={"offset": "-1"}, headers=auth)
        assert sorted(m["n"] for m in r.json()) == list(range(20))
    finally:
        guarded.kill()


def test_a_reused_sink_id_under_a_new_checkpoint_is_refused_loudly(
    registered: Any, srv: ServerProcess, tmp_path: Path
) -> None:
    """A new checkpoint location (batch ids start at 0 again) under a sinkId another query owns
    must fail with a message naming the sink, its last batch and its query, never skip rows."""
    seed(srv.url, "reuse/in", 60, per_append=20)

    def start(ckpt: Path) -> Any:
        return (
            registered.readStream.format("onceflow")
            .option("url", srv.url)
            .option("streams", "reuse/in")
            .option("maxRecordsPerTrigger", "20")
            .load()
            .selectExpr("value")
            .writeStream.format("onceflow")
            .option("url", srv.url)
            .option("stream", "reuse/out")
            .option("sinkId", "reuse")
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start()
        )

    first = start(tmp_path / "ckpt-1")
    first.awaitTermination()
    assert len(read_all(srv.url, "reuse/out")) == 60
    seed_more = [{"id": 100 + i, "key": 0} for i in range(10)]
    post(srv.url, "reuse/in", seed_more)
    second = start(tmp_path / "ckpt-2")  # another query: same sinkId, batch ids from 0
    with pytest.raises(Exception, match=r"sink 'reuse' belongs to query " + first.id):
        second.awaitTermination()
    assert len(read_all(srv.url, "reuse/out")) == 60  # nothing skipped silently, nothing doubled
    h = head(srv.url, "reuse/out")
    assert h.headers["stream-last-stable-offset"] == h.headers["stream-next-offset"]
    sink = httpx.get(f"{srv.url}/v1/sinks/reuse").json()
    assert sink["owner"] == first.id
    # a reset on purpose lets the new checkpoint take the sink: it writes its whole input
    r = httpx.post(f"{srv.url}/v1/sinks/reuse/reset", json={"owner": first.id})
    assert r.status_code == 200, r.text
    start(tmp_path / "ckpt-3").awaitTermination()
    assert len(read_all(srv.url, "reuse/out")) == 60 + 70
