"""The foreachBatch adapters (onceflow.spark.foreach_batch) with a real local[2] Spark, PostgreSQL and Redis.

The fault: Spark dies after the sink committed batch N but before Spark wrote ``commits/N`` (the
window of fault #8). It is made exactly: run the query, delete ``commits/N``, start it again on
the same checkpoint; Spark re-runs batch N with the same input, and the sink must add nothing.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from onceflow.sinks import SinkError
from onceflow.spark.foreach_batch import postgres_sink, redis_sink

FILES, ROWS_PER_FILE = 3, 4


def write_input(folder: Path) -> list[str]:
    folder.mkdir()
    expected = []
    for f in range(FILES):
        lines = []
        for r in range(ROWS_PER_FILE):
            i = f * ROWS_PER_FILE + r
            lines.append(json.dumps({"id": i, "v": f"value-{i}"}))
            expected.append(f"{i}:value-{i}")
        (folder / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    return expected


def make_target(kind: str, pg_info: str | None, redis: str | None, name: str) -> tuple[Any, Any]:
    """(a new foreachBatch function for the same sink name, a reader of the target as 'id:v' strings)"""
    if kind == "postgres":
        import psycopg

        assert pg_info is not None
        conninfo = pg_info
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS spark_out (id integer, v text)")

        def read() -> list[str]:
            with psycopg.connect(conninfo) as conn:
                return [f"{i}:{v}" for i, v in conn.execute("SELECT id, v FROM spark_out ORDER BY id").fetchall()]

        return (lambda: postgres_sink(conninfo, "spark_out", name=name, columns=["id", "v"])), read
    import redis as redis_lib

    assert redis is not None

    def read_list() -> list[str]:
        with redis_lib.Redis.from_url(redis) as r:
            items = [json.loads(x) for x in r.lrange(f"onceflow:{{{name}}}:out", 0, -1)]
        return sorted((f"{d['id']}:{d['v']}" for d in items), key=lambda s: int(s.split(":")[0]))

    return (lambda: redis_sink(redis, name=name)), read_list


def run_query(spark: Any, source: Path, checkpoint: Path, sink: Any) -> None:
    df = spark.readStream.schema("id INT, v STRING").option("maxFilesPerTrigger", 1).json(str(source))
    query = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_a_batch_replayed_after_the_sink_committed_adds_nothing(
    kind: str, spark: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pg_info = request.getfixturevalue("pg") if kind == "postgres" else None
    redis_u = request.getfixturevalue("redis_url") if kind == "redis" else None
    name = f"spark-{kind}-{uuid.uuid4().hex[:6]}"
    expected = write_input(tmp_path / "in")
    new_sink, read = make_target(kind, pg_info, redis_u, name)
    checkpoint = tmp_path / "checkpoint"

    first = new_sink()
    run_query(spark, tmp_path / "in", checkpoint, first)
    assert (first.written, first.skipped) == (FILES, 0)
    assert read() == expected

    # Spark "crashed" after the sink committed the last batch, before its commit log said so
    last = FILES - 1
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    again = new_sink()
    run_query(spark, tmp_path / "in", checkpoint, again)
    assert (again.written, again.skipped) == (0, 1)  # Spark really re-ran the batch; the sink skipped it
    assert read() == expected
    assert (checkpoint / "commits" / str(last)).exists()


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_direct_calls_are_keyed_by_batch_id_and_query(kind: str, spark: Any, request: pytest.FixtureRequest) -> None:
    pg_info = request.getfixturevalue("pg") if kind == "postgres" else None
    redis_u = request.getfixturevalue("redis_url") if kind == "redis" else None
    name = f"direct-{kind}-{uuid.uuid4().hex[:6]}"
    new_sink, read = make_target(kind, pg_info, redis_u, name)
    sink = new_sink()
    df = spark.createDataFrame([(1, "value-1"), (2, "value-2")], "id INT, v STRING")
    sink(df, 7)
    sink(df, 7)  # the same batch again
    sink(df, 3)  # an older one
    assert read() == ["1:value-1", "2:value-2"]
    assert (sink.written, sink.skipped) == (1, 2)
    sink(spark.createDataFrame([(3, "value-3")], "id INT, v STRING"), 8)
    assert read() == ["1:value-1", "2:value-2", "3:value-3"]

    sc = spark.sparkContext
    sc.setLocalProperty("sql.streaming.queryId", "first-query")
    try:
        sink(spark.createDataFrame([(4, "value-4")], "id INT, v STRING"), 9)
        sc.setLocalProperty("sql.streaming.queryId", "another-query")
        with pytest.raises(SinkError, match="query"):
            sink(spark.createDataFrame([(5, "value-5")], "id INT, v STRING"), 10)
    finally:
        sc.setLocalProperty("sql.streaming.queryId", None)
    assert read() == ["1:value-1", "2:value-2", "3:value-3", "4:value-4"]
    with pytest.raises(TypeError, match="batch_id"):
        sink(df, -1)
