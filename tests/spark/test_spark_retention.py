"""The Spark source and retention: a query whose start was deleted fails with a message saying how
to go on, or goes on from the earliest offset kept (``offsetReset``); with ``group``, a streaming
query's progress is a consumer group's offsets, which a stream can keep its data for."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.spark import earliest_after_retention, fill, retention_server

pytestmark = pytest.mark.slow
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with retention_server(tmp_path_factory.mktemp("spark-retention") / "data") as served:
        yield served


def ids(df: Any) -> list[int]:
    from pyspark.sql import functions as F

    return sorted(r.v.id for r in df.select(F.from_json("value", "id INT").alias("v")).collect())


def test_a_read_whose_start_was_deleted_fails_clearly_or_goes_on_as_told(registered: Any, url: str) -> None:
    offsets = fill(url, "sr/gone", 40, **{"Stream-Retention-Bytes": "1200"})
    earliest = earliest_after_retention(url, "sr/gone")

    def read(**options: str) -> Any:
        r = registered.read.format("onceflow").option("url", url).option("streams", "sr/gone")
        r = r.option("startingOffsets", json.dumps({"sr/gone": offsets[2]}))
        for k, v in options.items():
            r = r.option(k, v)
        return r.load()

    with pytest.raises(Exception) as failed:  # noqa: PT011 - Spark wraps the Python error in its own
        read().collect()
    assert earliest in str(failed.value) and "offsetReset" in str(failed.value)
    first = offsets.index(earliest) + 1
    assert ids(read(offsetReset="earliest")) == list(range(first, 40))
    assert ids(read(failOnDataLoss="false")) == list(range(first, 40))  # Kafka's spelling of the same
    with pytest.raises(Exception, match="failOnDataLoss=false"):  # noqa: PT011 - wrapped by Spark
        read(failOnDataLoss="true").collect()


def test_a_streaming_querys_group_keeps_what_it_may_replay(registered: Any, url: str, tmp_path: Path) -> None:
    offsets = fill(url, "sr/kept", 40, **{"Stream-Retention-Bytes": "600", "Stream-Retention-Keep-Groups": "etl"})
    time.sleep(1.5)  # a few retention sweeps: the group has no offset yet, so nothing may go
    assert "stream-earliest-offset" not in httpx.head(f"{url}/v1/stream/sr/kept").headers
    q = (
        registered.readStream.format("onceflow")
        .option("url", url)
        .option("streams", "sr/kept")
        .option("group", "etl")
        .option("maxRecordsPerTrigger", "15")
        .load()
        .writeStream.format("memory")
        .queryName("sr_kept")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    assert ids(registered.table("sr_kept")) == list(range(40))
    # Spark commits a micro-batch's end to the source when it plans the next one: the group holds
    # the end of the last batch but one, and the last batch, which a restart may replay, is kept
    committed = httpx.get(f"{url}/v1/groups/etl/offsets").json()["offsets"]["sr/kept"]
    assert committed == offsets[29]  # batches of 15: [0, 15), [15, 30), [30, 40)
    earliest = earliest_after_retention(url, "sr/kept")  # what the query is past may go now
    assert earliest <= committed
    kept = httpx.get(f"{url}/v1/stream/sr/kept", params={"offset": "-1"}).json()
    assert [m["id"] for m in kept][-10:] == list(range(30, 40))
