"""kill -9 of the Spark driver at the worst moments, through `onceflow demo` (the README's main job).

Three driver crashes per run, as ``./run.sh`` makes them: right after the sink committed batch N but
before Spark wrote its commit log (Spark re-runs N with the same offsets), inside ``write()`` with
rows written in an open transaction, and one at a random moment (each restart costs CI about half a
minute of JVM start: more crashes are the soak's). The data is then checked here, independently of the
demo's own report: the output holds every input event exactly once. The soak is
``onceflow demo --crashes 20``.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers.servers import ServerProcess
from helpers.spark import read_all

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_driver_kill9_after_commit_inside_write_and_at_random_is_exactly_once(tmp_path: Path) -> None:
    pytest.importorskip("pyspark", reason="pyspark is part of the dev install (scripts/setup.sh dev)")
    work = tmp_path / "demo"
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow.cli",
            "demo",
            "--events",
            "3000",
            "--crashes",
            "3",
            "--drop-acks",
            "0.3",
            "--max-records-per-trigger",
            "400",
            "--seed",
            "5",
            "--keep",
            str(work),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=880,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-4000:]
    assert "exactly-once: OK" in run.stdout
    log = (work / "driver.log").read_text()
    crashes = (work / "checkpoint" / "crashes.log").read_text()
    # the planned crashes really happened where they were meant to
    assert "crashing on purpose: after the sink committed batch" in crashes
    assert "crashing on purpose: inside write() of batch" in crashes
    # 3 killed and 1 to finish; more if Spark failed by itself before a planned crash (the demo then
    # restarts it and plans that crash again: see "exited by itself" in its report)
    assert log.count("=== driver start") >= 4

    # check the data again here, from the server's files
    srv = ServerProcess(work / "data")
    srv.start()
    try:
        events = read_all(srv.url, "demo/events")
        enriched = read_all(srv.url, "demo/enriched")
        counts = read_all(srv.url, "demo/counts")
        assert sorted(e["id"] for e in events) == list(range(3000))  # producer: no loss, no duplicate
        assert sorted(e["id"] for e in enriched) == list(range(3000))  # pipeline: exactly once
        by_id = {e["id"]: e for e in events}
        assert all(x["user"] == by_id[x["id"]]["user"] and x["tier"] in ("big", "small") for x in enriched)
        truth = collections.Counter(e["user"] for e in events)
        latest = {c["user"]: c["events"] for c in counts}
        assert latest == dict(truth)
        for stream in ("demo/enriched", "demo/counts"):
            h = httpx.head(f"{srv.url}/v1/stream/{stream}")
            assert h.headers["stream-last-stable-offset"] == h.headers["stream-next-offset"]  # nothing left open
    finally:
        srv.kill()
