"""The sink's driver when the answer to its commit is lost (issue item 11): a :class:`FaultProxy`
forwards the commit, lets the server commit it, and holds the answer on the open connection far
longer than the user's ``requestTimeoutSeconds``. First the driver's own commit
(``writer._commit``, what ``commit(messages)`` runs) with no Spark session, then a Spark job.

The commit is idempotent by design (the same decision again is answered ``committed``), so the
driver must resolve the lost answer within that deadline: the job is told "committed" for a batch
that committed, never "failed" (a re-run by the user would then double the rows). When no answer
comes at all within the deadline, it says the outcome is unknown rather than that it failed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess
from helpers.spark import read_all
from onceflow.client import OutcomeUnknownError
from onceflow.client.lowlevel import async_http_client
from onceflow.spark.options import Options
from onceflow.spark.protocol import TaskResult, TaskSpec, WriterSettings, run_task, task_name
from onceflow.testing import FaultProxy

pytestmark = pytest.mark.slow
pytest.importorskip("pyspark", reason="pyspark is part of the dev install (scripts/setup.sh dev)")

HELD = 3600.0  # the proxy holds the commit's answer this long: for ever, as far as the driver knows


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path / "data", "--log-level", "error")
    s.start()
    try:
        yield s
    finally:
        s.kill()


def _opts(url: str, sink: str, deadline: int) -> Options:
    return Options.parse({"url": url, "stream": "out", "sinkId": sink, "requestTimeoutSeconds": str(deadline)})


async def _tasks(url: str, settings: WriterSettings, batch: int) -> list[TaskResult]:
    """Two tasks of ``batch`` (straight to the server), each leaving its transaction open."""
    async with async_http_client(url, timeout=30.0) as client:
        return [
            await run_task(
                client,
                settings,
                TaskSpec(batch, "Q", part, task_name("run", 0, part)),
                [{"out": [json.dumps({"id": part * 10 + i}).encode() for i in range(10)]}],
            )
            for part in range(2)
        ]


def _commit(opts: Options, settings: WriterSettings, batch: int, results: list[TaskResult]) -> str:
    from onceflow.spark.writer import TaskCommit, _commit

    return asyncio.run(_commit(opts, settings, batch, [TaskCommit(r) for r in results]))


@pytest.mark.timeout(120)
def test_a_commit_whose_answer_is_held_on_an_open_connection_is_committed_once(srv: ServerProcess) -> None:
    """The first answer to the commit is held; requestTimeoutSeconds is 4. The driver's request
    used to wait the HTTP client's fixed 30 s, then give up (past the deadline) with the commit
    done: the job failed, a re-run doubled the rows. Now each attempt's timeout is a share of the
    deadline and the retried commit (the same decision) is answered committed."""
    with FaultProxy(srv.port, paths=("/commit",), delay=HELD, max_faults=1) as proxy:
        opts = _opts(proxy.url, "held", 4)
        settings = opts.writer_settings("held")
        results = asyncio.run(_tasks(srv.url, settings, 0))
        assert _commit(opts, settings, 0, results) == "committed"
        assert proxy.responses_delayed == 1 and proxy.matched >= 2  # the answer was held; a retry got through
    assert sorted(m["id"] for m in read_all(srv.url, "out")) == list(range(20))
    sink = httpx.get(f"{srv.url}/v1/sinks/held").json()
    assert sink["batch"] == 0


@pytest.mark.timeout(120)
def test_a_commit_with_no_answer_within_the_deadline_is_reported_unknown_not_failed(srv: ServerProcess) -> None:
    """Every answer to the commit is held past the deadline: the driver cannot learn what became
    of the batch, and says so (``OutcomeUnknownError``, naming where to look), within about the
    deadline, not after the HTTP client's own 30 s. The commit did happen."""
    with FaultProxy(srv.port, paths=("/commit",), delay=HELD) as proxy:
        opts = _opts(proxy.url, "lost", 2)
        settings = opts.writer_settings("lost")
        results = asyncio.run(_tasks(srv.url, settings, 0))
        with pytest.raises(OutcomeUnknownError) as info:
            _commit(opts, settings, 0, results)
        assert "/v1/sinks/lost" in str(info.value) and proxy.responses_delayed >= 2
    assert sorted(m["id"] for m in read_all(srv.url, "out")) == list(range(20))


@pytest.mark.timeout(300)
def test_a_spark_batch_write_whose_commit_answer_is_held_succeeds_with_its_rows_once(
    spark: Any, srv: ServerProcess
) -> None:
    """``df.write.format("onceflow")`` with requestTimeoutSeconds 4, the first answer to its commit
    held: the job used to fail (after the client's 30 s) although the rows were committed, and
    the user's re-run doubled them. Now the job succeeds and the rows are there once."""
    import onceflow.spark

    onceflow.spark.register(spark)
    df = spark.createDataFrame([(json.dumps({"id": i}),) for i in range(50)], "value STRING").repartition(2)
    with FaultProxy(srv.port, paths=("/commit",), delay=HELD, max_faults=1) as proxy:
        (
            df.write.format("onceflow")
            .option("url", proxy.url)
            .option("stream", "job")
            .option("requestTimeoutSeconds", "4")
            .mode("append")
            .save()
        )
        assert proxy.responses_delayed == 1
    assert sorted(m["id"] for m in read_all(srv.url, "job")) == list(range(50))


@pytest.mark.timeout(300)
def test_a_streaming_query_whose_commit_answer_is_held_goes_on_with_its_rows_once(
    spark: Any, srv: ServerProcess, tmp_path: Path
) -> None:
    """The same for ``writeStream``: the first answer to the commit of its only micro-batch held,
    requestTimeoutSeconds 4. The query used to stop with an error (its batch committed); now it
    ends as it should and the rows are there once."""
    import onceflow.spark

    onceflow.spark.register(spark)
    assert httpx.put(f"{srv.url}/v1/stream/s/in", headers={"content-type": "application/json"}).status_code == 201
    rows = [{"id": i} for i in range(40)]
    assert httpx.post(f"{srv.url}/v1/stream/s/in", json=rows).status_code in (200, 204)
    with FaultProxy(srv.port, paths=("/commit",), delay=HELD, max_faults=1) as proxy:
        query = (
            spark.readStream.format("onceflow")
            .option("url", srv.url)
            .option("streams", "s/in")
            .load()
            .selectExpr("value")
            .writeStream.format("onceflow")
            .option("url", proxy.url)
            .option("stream", "s/out")
            .option("sinkId", "held-stream")
            .option("requestTimeoutSeconds", "4")
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination(240)  # raises the query's error
        finally:
            query.stop()
        assert query.exception() is None and proxy.responses_delayed == 1
    assert sorted(m["id"] for m in read_all(srv.url, "s/out")) == list(range(40))
