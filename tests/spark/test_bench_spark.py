"""``onceflow bench spark`` compares like with like: both pipelines cut the input into the same
micro-batches, and the onceflow one delivers every row exactly once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = ServerProcess(tmp_path_factory.mktemp("bench-spark") / "data")
    s.start()
    yield s
    s.kill()


def test_both_pipelines_take_the_same_micro_batches(spark: Any, srv: ServerProcess, tmp_path: Path) -> None:
    import onceflow.spark
    from onceflow_tools.bench.spark import ROW, MemoryDataSource, phases, run_pipeline

    onceflow.spark.register(spark)
    spark.dataSource.register(MemoryDataSource)
    rows = 30
    r = httpx.put(f"{srv.url}/v1/stream/bench-in", headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text
    for a in range(0, rows, 5):  # a micro-batch ends between appends: appends of 5 rows
        body = "[" + ",".join(ROW % (i, i % 40, i % 100) for i in range(a, a + 5)) + "]"
        r = httpx.post(f"{srv.url}/v1/stream/bench-in", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 204, r.text

    batches = {}
    for side in ("memory", "onceflow"):
        q = run_pipeline(
            spark,
            side,
            url=srv.url,
            stream="bench-in",
            rows=rows,
            out="bench-out",
            checkpoint=tmp_path / side,
            max_records=10,
            per_partition=5,
        )
        batches[side] = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
        assert phases(q)["addBatch"] > 0
    assert batches == {"memory": [10, 10, 10], "onceflow": [10, 10, 10]}

    got = httpx.get(f"{srv.url}/v1/stream/bench-out", params={"offset": "-1"}).json()
    assert sorted(m["id"] for m in got) == list(range(rows))
    assert got[0] == json.loads(ROW % (got[0]["id"], got[0]["id"] % 40, got[0]["id"] % 100))
