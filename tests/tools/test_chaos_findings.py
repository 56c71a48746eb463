"""Anomalies the chaos harness found, reproduced deterministically (docs/reliability.md, "Findings").

Each test states the invariant a user relies on and failed before its fix: a commit decision whose
record could not be written (a full disk) was kept in memory and carried out anyway.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.disk import Disk
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig

pytestmark = pytest.mark.anyio
S = "/v1/stream/"


async def test_a_commit_whose_decision_was_not_logged_is_not_carried_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chaos run `--duration 120 --seed 2`: on a full disk the copier's commit failed writing PREPARE_COMMIT;
    its output became visible anyway and, after the restart, its offsets were not, so it was copied twice."""
    data = tmp_path / "data"
    broker = Broker(data)
    broker.open()
    await broker.start()
    app = App(broker, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for s in ("in", "out"):
            assert (await c.put(S + s, headers={"content-type": "application/json"})).status_code == 201
        end_of_input = (
            await c.post(S + "in", content=b'{"n":1}', headers={"content-type": "application/json"})
        ).headers["stream-next-offset"]
        epoch = (await c.post("/v1/txn/copier/init", json={})).json()["epoch"]
        h = {
            "content-type": "application/json",
            "producer-id": "txn:copier",
            "producer-epoch": str(epoch),
            "producer-seq": "0",
            "transaction-id": "copier",
        }
        r = await c.post(S + "out", content=b'{"n":1}', headers=h)
        txn = int(r.headers["transaction-number"])
        assert (
            await c.post("/v1/txn/copier/offsets", json={"epoch": epoch, "group": "g", "offsets": {"in": end_of_input}})
        ).status_code == 200

        coord: Any = broker.coordinator
        disk = Disk(monkeypatch)
        disk.fail(coord.log)  # the decision record cannot be written
        r = await c.post("/v1/txn/copier/commit", json={"epoch": epoch, "txn": txn})
        assert r.status_code >= 500  # not acknowledged: the client must not believe it committed
        assert disk.failed
        disk.heal()  # space returns
        await coord.expire()  # the periodic sweep
        visible = (await c.get(S + "out", params={"offset": "-1"})).json()
        # a crash now: what does a restarted server make of it?
        shutil.copytree(data, tmp_path / "after-crash")
    await broker.close()
    again = Broker(tmp_path / "after-crash")
    again.open()
    await again.start()
    app2 = App(again, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app2), base_url="http://t") as c:
        out_after = (await c.get(S + "out", params={"offset": "-1"})).json()
        offsets_after = (await c.get("/v1/groups/g/offsets")).json()["offsets"]
    await again.close()
    # exactly once: the output and the input offsets are one decision, before and after a crash
    assert (visible == [{"n": 1}]) == (out_after == [{"n": 1}]) == (offsets_after.get("in") == end_of_input)


async def test_a_transaction_over_two_streams_is_never_half_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`onceflow chaos --duration 45 --seed 1` (tests/tools/test_chaos.py) on a full disk: a transaction over tx/0
    and tx/1 whose commit failed ended with its tx/1 part committed and its tx/0 part aborted."""
    data = tmp_path / "data"
    broker = Broker(data)
    broker.open()
    await broker.start()
    app = App(broker, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for s in ("a", "b"):
            assert (await c.put(S + s, headers={"content-type": "application/json"})).status_code == 201
        epoch = (await c.post("/v1/txn/t/init", json={})).json()["epoch"]
        h = {
            "content-type": "application/json",
            "producer-id": "txn:t",
            "producer-epoch": str(epoch),
            "producer-seq": "0",
            "transaction-id": "t",
        }
        txn = int((await c.post(S + "a", content=b'{"s":"a"}', headers=h)).headers["transaction-number"])
        assert (await c.post(S + "b", content=b'{"s":"b"}', headers=h)).status_code == 200

        coord: Any = broker.coordinator
        real_marker = coord.write_marker
        disk = Disk(monkeypatch)
        disk.fail(coord.log)  # the decision record cannot be written
        assert (await c.post("/v1/txn/t/commit", json={"epoch": epoch, "txn": txn})).status_code >= 500
        assert disk.failed
        disk.heal()

        async def marker_b_fails(stream: str, *args: Any) -> None:
            if stream == "b":
                raise OSError(errno.EFBIG, "File too large")
            await real_marker(stream, *args)

        coord.write_marker = marker_b_fails  # b's segment is still at the size limit
        with contextlib.suppress(OSError):
            await coord.expire()  # the periodic sweep
        coord.write_marker = real_marker
        shutil.copytree(data, tmp_path / "after-crash")  # kill -9 now
    await broker.close()
    again = Broker(tmp_path / "after-crash")
    again.open()
    await again.start()
    app2 = App(again, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app2), base_url="http://t") as c:
        await again.coordinator.expire()
        a = (await c.get(S + "a", params={"offset": "-1"})).json()
        b = (await c.get(S + "b", params={"offset": "-1"})).json()
    await again.close()
    assert (a, b) in (([], []), ([{"s": "a"}], [{"s": "b"}])), (a, b)  # all or nothing
