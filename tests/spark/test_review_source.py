"""Review of issue 32 item 4: the stream reader's decisions on the driver, without a Spark session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.spark import earliest_after_retention, fill, retention_server

pytestmark = pytest.mark.slow
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with retention_server(tmp_path_factory.mktemp("review-source") / "data") as served:
        yield served


def rows(reader: Any, start: dict[str, str], end: dict[str, str]) -> list[int]:
    out: list[int] = []
    for part in reader.partitions(start, end):
        for batch in reader.read(part):
            out += [json.loads(v)["id"] for v in batch.column(3).to_pylist()]
    return out


def test_a_limited_query_goes_on_from_the_earliest_offset_kept_at_once(url: str) -> None:
    """offsetReset=earliest (failOnDataLoss=false) with maxRecordsPerTrigger: the first micro-batch
    after retention deleted the query's start reads the limit's rows from the earliest offset kept,
    as before positions inside an append: not empty micro-batches through the deleted records."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from onceflow.spark.options import Options
    from onceflow.spark.source import OnceflowStreamReader

    offsets = fill(url, "rv/gone", 40, **{"Stream-Retention-Bytes": "1200"})
    earliest = earliest_after_retention(url, "rv/gone")
    first = offsets.index(earliest) + 1
    opts = Options.parse(
        {"url": url, "streams": "rv/gone", "failOnDataLoss": "false", "maxRecordsPerTrigger": "3"}, "source"
    )
    reader = OnceflowStreamReader(opts, text_values=True)
    try:
        start = {"rv/gone": offsets[1]}
        end = reader.latestOffset(start, ReadMaxRows(3))
        assert rows(reader, start, end) == list(range(first, first + 3))
    finally:
        reader.stop()


def test_a_position_inside_an_append_retention_deleted_goes_on_from_the_earliest_offset_kept(url: str) -> None:
    """A checkpoint whose offset is inside an append (``<record>@<lo>..<hi>``) that retention then
    deleted: with failOnDataLoss=false the next micro-batch reads the limit's rows from the
    earliest offset kept, each once; the group commit names an offset, never the text of a cut."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from onceflow.spark.options import Options
    from onceflow.spark.source import OnceflowStreamReader

    name = "rv/cut-gone"
    r = httpx.put(f"{url}/v1/stream/{name}", headers={**JSON, "Stream-Retention-Bytes": "1200"})
    assert r.status_code == 201, r.text
    lo = httpx.post(f"{url}/v1/stream/{name}", json=[{"id": -1}], headers=JSON).headers["stream-next-offset"]
    hi = httpx.post(
        f"{url}/v1/stream/{name}", json=[{"id": 1000 + i, "pad": "x" * 60} for i in range(10)], headers=JSON
    ).headers["stream-next-offset"]
    for i in range(30):
        r = httpx.post(f"{url}/v1/stream/{name}", json=[{"id": i, "pad": "x" * 60}], headers=JSON)
        assert r.status_code in (200, 204), r.text
    earliest = earliest_after_retention(url, name)
    assert earliest > hi
    opts = Options.parse(
        {"url": url, "streams": name, "failOnDataLoss": "false", "maxOffsetsPerTrigger": "4", "group": "rv"}, "source"
    )
    reader = OnceflowStreamReader(opts, text_values=True)
    try:
        start = {name: f"6@{lo}..{hi}"}
        seen: list[int] = []
        for _ in range(20):
            end = reader.latestOffset(start, ReadMaxRows(4))
            if end == start:
                break
            got = rows(reader, start, end)
            assert len(got) == 4 or end[name] == reader.streams.ends(reader.conn)[name]
            seen += got
            reader.commit(end)
            start = end
        kept = httpx.get(f"{url}/v1/stream/{name}", params={"offset": earliest}).json()
        assert seen == [m["id"] for m in kept]
    finally:
        reader.stop()


def test_a_cut_in_the_first_append_of_a_fresh_query_does_not_hide_what_retention_deleted(url: str) -> None:
    """A fresh query (startingOffsets earliest) whose first micro-batch ended inside the stream's
    first append, then retention deleted that append: by default (failOnDataLoss=true) the next
    micro-batch fails naming what was deleted, as for any other deleted start; it did not read on
    silently from the earliest offset kept (the cut was written from "-1", which a read takes as
    "wherever the stream begins now")."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from onceflow.client import OffsetGoneError
    from onceflow.spark.options import Options
    from onceflow.spark.source import Cut, OnceflowStreamReader

    name = "rv/first-cut"
    r = httpx.put(f"{url}/v1/stream/{name}", headers={**JSON, "Stream-Retention-Bytes": "1200"})
    assert r.status_code == 201, r.text
    httpx.post(f"{url}/v1/stream/{name}", json=[{"id": 1000 + i, "pad": "x" * 60} for i in range(10)], headers=JSON)
    opts = Options.parse({"url": url, "streams": name, "maxRecordsPerTrigger": "4"}, "source")
    reader = OnceflowStreamReader(opts, text_values=True)
    try:
        start = reader.initialOffset()
        first = reader.latestOffset(start, ReadMaxRows(4))
        assert Cut.parse(first[name]).inside
        assert rows(reader, start, first) == [1000, 1001, 1002, 1003]
        for i in range(30):
            httpx.post(f"{url}/v1/stream/{name}", json=[{"id": i, "pad": "x" * 60}], headers=JSON)
        earliest_after_retention(url, name)
        with pytest.raises(OffsetGoneError):
            nxt = reader.latestOffset(first, ReadMaxRows(4))
            rows(reader, first, nxt)
    finally:
        reader.stop()


@pytest.mark.parametrize(
    "text",
    [
        "5@..",  # read as the empty token, the stream's start: the query would read it all again
        "5@-1..-1",
        "5@0000000000000003_0000000000000300..0000000000000003_0000000000000300",
        "2@0000000000000003_0000000000000300..0000000000000009_0000000000000900",  # record before lo
        "9@0000000000000003_0000000000000300..0000000000000009_0000000000000900",  # record at hi
        "5@x..0000000000000009_0000000000000900",
        "5@0000000000000003_0000000000000300..y",
        "05x@0000000000000003_0000000000000300..0000000000000009_0000000000000900",
        "orders",
    ],
)
def test_a_corrupt_position_is_refused_naming_it(text: str) -> None:
    """An offset of the source's checkpoint that is no position it writes is an error that names
    it, before any read: not a read of other rows than the offset stood for."""
    from onceflow.spark.source import Cut

    with pytest.raises(ValueError, match="not a position of the onceflow source|not an onceflow offset"):
        Cut.parse(text)
