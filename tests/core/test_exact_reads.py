"""The extensions the Spark connector stands on: exact-range reads and many transactions, one commit.

In process (no Spark): ``format=records`` / ``format=boundaries`` reads, and ``/v1/sinks/<id>``.
"""

from __future__ import annotations

import inspect
import struct
from pathlib import Path
from typing import Any

import pytest

from helpers.disk import Disk
from helpers.servers import InProcess
from helpers.ticks import ticking
from helpers.txn import JSON, S, Txn, committed, make, uncommitted
from onceflow.core.broker import Broker
from onceflow.spark._http import record_offset
from onceflow.spark.source import split_json

pytestmark = pytest.mark.anyio
FRAME = struct.Struct("<qIqI")  # the documented layout, spelt out here on purpose (not onceflow.wire.FRAME)


def frames(body: bytes) -> list[tuple[int, int, list[Any]]]:
    """(first record offset, count, messages) of each frame of a format=records JSON read."""
    import json

    out, p = [], 0
    while p < len(body):
        base, count, _ts, size = FRAME.unpack_from(body, p)
        p += FRAME.size
        out.append((base, count, [json.loads(t) for t in split_json(body[p : p + size])]))
        p += size
    return out


async def append(c: InProcess, name: str, values: list[Any]) -> str:
    r = await c.client.post(S + name, json=values, headers=JSON)
    assert r.status_code in (200, 204), r.text
    return r.headers["stream-next-offset"]


async def test_records_read_stops_exactly_at_until_and_keeps_offsets(onceflow: InProcess) -> None:
    await make(onceflow, "s")
    first = await append(onceflow, "s", [{"i": 0}, {"i": 1}])
    second = await append(onceflow, "s", [{"i": 2}])
    await append(onceflow, "s", [{"i": 3}, {"i": 4}])
    r = await onceflow.client.get(S + "s", params={"offset": "-1", "until": second, "format": "records"})
    assert r.status_code == 200
    assert r.headers["stream-next-offset"] == second
    assert r.headers["stream-content-type"] == "application/json"
    assert frames(r.content) == [(0, 2, [{"i": 0}, {"i": 1}]), (2, 1, [{"i": 2}])]
    # the same range again reads the same bytes, even after more appends
    await append(onceflow, "s", [{"i": 5}])
    again = await onceflow.client.get(S + "s", params={"offset": "-1", "until": second, "format": "records"})
    assert again.content == r.content
    mid = await onceflow.client.get(S + "s", params={"offset": first, "until": second, "format": "records"})
    assert frames(mid.content) == [(2, 1, [{"i": 2}])]


async def test_records_read_leaves_out_aborted_data_and_stops_at_the_lso(onceflow: InProcess) -> None:
    await make(onceflow, "s")
    t = Txn(onceflow.client, "w")
    await t.init()
    await t.send("s", {"aborted": True})
    assert (await t.end(commit=False)).status_code == 200
    await append(onceflow, "s", [{"plain": 1}])
    await t.send("s", {"open": True})  # open: the LSO stops here
    await append(onceflow, "s", [{"plain": 2}])
    r = await onceflow.client.get(S + "s", params={"offset": "-1", "format": "records"})
    assert [m for _, _, ms in frames(r.content) for m in ms] == [{"plain": 1}]
    head = await onceflow.client.head(S + "s")
    assert r.headers["stream-next-offset"] == head.headers["stream-last-stable-offset"]
    unc = await onceflow.client.get(
        S + "s", params={"offset": "-1", "format": "records", "isolation": "read_uncommitted"}
    )
    assert [m for _, _, ms in frames(unc.content) for m in ms] == [
        {"aborted": True},
        {"plain": 1},
        {"open": True},
        {"plain": 2},
    ]


async def test_boundaries_split_a_range_and_bound_a_trigger(onceflow: InProcess) -> None:
    await make(onceflow, "s")
    ends = [await append(onceflow, "s", [{"i": i}] * 3) for i in range(6)]  # 6 batches of 3 records
    r = await onceflow.client.get(S + "s", params={"offset": "-1", "format": "boundaries", "every": "7"})
    body = r.json()
    assert body["end"] == ends[-1]
    # boundaries fall between batches, at least 7 records apart; the end itself is not one
    assert body["boundaries"] == [ends[2]]
    assert record_offset(ends[2]) == 9
    capped = await onceflow.client.get(S + "s", params={"offset": ends[0], "format": "boundaries", "max_records": "7"})
    assert capped.json()["end"] == ends[2]  # 6 records fit in 7; a third batch would make 9
    one = await onceflow.client.get(S + "s", params={"offset": ends[0], "format": "boundaries", "max_records": "1"})
    assert one.json()["end"] == ends[1]  # at least one batch, even when it is bigger than the cap


async def test_position_finds_the_first_batch_appended_at_or_after_a_time(onceflow: InProcess) -> None:
    """``format=position&time_ms=T`` (the Spark source's ``startingTimestamp``): the offset of the first
    batch stamped at or after T, by the lookup a group reset by time makes; the tail when none was."""

    class Clock:
        now = 1_800_000_000.0

        def time(self) -> float:
            return self.now

        def monotonic(self) -> float:
            return self.now

    clock = Clock()
    onceflow.broker.clock = clock
    await make(onceflow, "t")
    ends = []
    for i in range(3):
        ends.append(await append(onceflow, "t", [{"i": i}] * 2))
        clock.now += 10
    t0 = 1_800_000_000_000

    async def at(time_ms: int) -> str:
        r = await onceflow.client.get(S + "t", params={"format": "position", "time_ms": str(time_ms)})
        assert r.status_code == 200, r.text
        return str(r.json()["offset"])

    assert record_offset(await at(0)) == 0
    assert await at(t0 + 1) == ends[0]  # the second batch, stamped t0 + 10 s
    assert await at(t0 + 10_000) == ends[0]
    assert await at(t0 + 20_000) == ends[1]
    assert await at(t0 + 20_001) == ends[2]  # none that late: the tail


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"offset": "-1", "format": "xml"}, "format must be records, boundaries or position"),
        ({"format": "position"}, "format=position needs time_ms"),
        ({"format": "position", "time_ms": "-5"}, "format=position needs time_ms"),
        # more digits than Python's int() takes from a string (4300) were a 500
        ({"format": "position", "time_ms": "1" * 5000}, "format=position needs time_ms"),
        ({"format": "position", "time_ms": "5\n"}, "format=position needs time_ms"),
        ({"offset": "-1", "format": "boundaries", "every": "1" * 5000}, "every must be a positive integer"),
        ({"offset": "-1", "format": "records", "max_bytes": "1" * 5000}, "max_bytes must be an integer"),
        ({"offset": "-1", "format": "records", "until": "nonsense"}, "until must be an offset"),
        ({"offset": "-1", "format": "records", "until": "now"}, "until must be an offset"),
        ({"offset": "-1", "format": "boundaries", "every": "0"}, "every must be a positive integer"),
        ({"offset": "-1", "format": "boundaries", "max_records": "x"}, "max_records must be a positive integer"),
        ({"offset": "-1", "format": "records", "live": "long-poll"}, "not live"),
    ],
)
async def test_bad_exact_read_parameters_are_400_with_a_reason(
    onceflow: InProcess, params: dict[str, str], needle: str
) -> None:
    await make(onceflow, "s")
    await append(onceflow, "s", [1])
    r = await onceflow.client.get(S + "s", params=params)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]


async def test_until_before_offset_is_refused(onceflow: InProcess) -> None:
    await make(onceflow, "s")
    a = await append(onceflow, "s", [1])
    b = await append(onceflow, "s", [2])
    r = await onceflow.client.get(S + "s", params={"offset": b, "until": a, "format": "records"})
    assert r.status_code == 400 and "before" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- many transactions, one commit


async def two_tasks(c: InProcess, sink: str) -> tuple[Txn, Txn]:
    await make(c, "x", "y")
    a, b = Txn(c.client, f"spark/{sink}/p0/a0"), Txn(c.client, f"spark/{sink}/p1/a0")
    for t in (a, b):
        await t.init()
    await a.send("x", {"from": "a"})
    await b.send("x", {"from": "b"})
    await b.send("y", {"from": "b"})
    return a, b


def members(*ts: Txn) -> list[dict[str, Any]]:
    return [{"id": t.tid, "epoch": t.epoch, "txn": t.txn} for t in ts]


async def test_members_commit_as_one_and_a_replayed_batch_adds_nothing(onceflow: InProcess) -> None:
    a, b = await two_tasks(onceflow, "q")
    assert await committed(onceflow, "x") == []
    r = await onceflow.client.post(
        "/v1/sinks/q/commit", json={"batch": 7, "members": members(a, b), "abort_prefix": "spark/q/"}
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"sink": "q", "status": "committed", "batch": 7}
    assert sorted(m["from"] for m in await committed(onceflow, "x")) == ["a", "b"]
    assert await committed(onceflow, "y") == [{"from": "b"}]
    # the same request again (a lost answer) is told its decision committed; a re-run of batch 7
    # with fresh transactions adds nothing
    again = await onceflow.client.post("/v1/sinks/q/commit", json={"batch": 7, "members": members(a, b)})
    assert again.json()["status"] == "committed"
    for t in (a, b):
        await t.init()
        await t.send("x", {"rerun": t.tid})
    rerun = await onceflow.client.post(
        "/v1/sinks/q/commit", json={"batch": 7, "members": members(a, b), "abort_prefix": "spark/q/"}
    )
    assert rerun.json() == {"sink": "q", "status": "already_committed", "batch": 7}
    assert sorted(m["from"] for m in await committed(onceflow, "x")) == ["a", "b"]
    head = await onceflow.client.head(S + "x")
    assert head.headers["stream-last-stable-offset"] == head.headers["stream-next-offset"]  # the re-run was aborted
    assert (await onceflow.client.get("/v1/sinks/q")).json() == {"sink": "q", "batch": 7, "owner": None, "rows": None}


async def test_leftover_attempts_under_the_prefix_are_aborted(onceflow: InProcess) -> None:
    a, b = await two_tasks(onceflow, "q")
    failed = Txn(onceflow.client, "spark/q/p1/a1")  # an attempt whose answer Spark did not use
    await failed.init()
    await failed.send("y", {"from": "speculative"})
    other = Txn(onceflow.client, "spark/qq/p0/a0")  # another sink: not under "spark/q/"
    await other.init()
    await other.send("y", {"from": "other sink"})
    r = await onceflow.client.post(
        "/v1/sinks/q/commit", json={"batch": 0, "members": members(a, b), "abort_prefix": "spark/q/"}
    )
    assert r.json()["status"] == "committed"
    assert await committed(onceflow, "y") == [{"from": "b"}]
    assert {"from": "speculative"} in await uncommitted(onceflow, "y")
    status = (await onceflow.client.get("/v1/txn/spark/q/p1/a1")).json()["status"]
    assert status == "complete_abort"
    assert (await onceflow.client.get("/v1/txn/spark/qq/p0/a0")).json()["status"] == "ongoing"


async def test_a_fenced_member_fails_the_commit_and_nothing_is_visible(onceflow: InProcess) -> None:
    a, b = await two_tasks(onceflow, "q")
    stale = members(a, b)
    await b.init()  # a zombie's epoch: b's old transaction is aborted
    r = await onceflow.client.post(
        "/v1/sinks/q/commit", json={"batch": 1, "members": stale, "abort_prefix": "spark/q/"}
    )
    assert r.status_code == 403, r.text
    assert await committed(onceflow, "x") == []
    head = await onceflow.client.head(S + "x")
    assert head.headers["stream-last-stable-offset"] == head.headers["stream-next-offset"]  # a was aborted too
    assert (await onceflow.client.get("/v1/sinks/q")).json()["batch"] is None


async def test_abort_drops_members_and_leftovers(onceflow: InProcess) -> None:
    a, b = await two_tasks(onceflow, "q")
    r = await onceflow.client.post("/v1/sinks/q/abort", json={"members": members(a), "abort_prefix": "spark/q/"})
    assert r.status_code == 200
    assert await committed(onceflow, "x") == [] and await committed(onceflow, "y") == []
    for t in (a, b):
        assert (await onceflow.client.get("/v1/txn/" + t.tid)).json()["status"] == "complete_abort"


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/v1/sinks/q/commit", {"batch": 1}, 400),
        ("/v1/sinks/q/commit", {"batch": -1, "members": []}, 400),
        ("/v1/sinks/q/commit", {"members": [{"id": "t", "epoch": 0}]}, 400),
        ("/v1/sinks/q/commit", {"members": [{"id": "never-initialised", "epoch": 0, "txn": 1}]}, 404),
        ("/v1/sinks/q/commit", {"members": [], "abort_prefix": ""}, 400),
        ("/v1/sinks/q/frobnicate", {"members": []}, 404),
    ],
)
async def test_bad_sink_requests_get_a_clear_4xx(
    onceflow: InProcess, path: str, body: dict[str, Any], status: int
) -> None:
    r = await onceflow.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


async def test_recovery_finishes_a_commit_whose_record_is_durable(tmp_path: Path) -> None:
    """The coordinator record is the commit point: a crash before any marker is written still
    ends with every member's data visible after a restart, and the batch id recorded."""
    import httpx

    from onceflow.server.app import App, AppConfig

    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.3))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        c = InProcess(broker, app, client, tmp_path / "data")
        a, b = await two_tasks(c, "q")

        async def crash(*_: object) -> None:
            raise OSError("simulated crash before the markers")

        broker.coordinator.write_marker = crash
        with pytest.raises(OSError):
            await broker.coordinator.commit_members("q", 3, [(t.tid, t.epoch, t.txn) for t in (a, b)], "spark/q/")
    # the first broker is abandoned without a clean close, like a killed process
    again = Broker(tmp_path / "data")
    again.open()
    await again.start()
    try:
        app2 = App(again, AppConfig(long_poll_timeout=0.3))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app2), base_url="http://t") as client:
            c2 = InProcess(again, app2, client, tmp_path / "data")
            assert sorted(m["from"] for m in await committed(c2, "x")) == ["a", "b"]
            assert await committed(c2, "y") == [{"from": "b"}]
            assert (await client.get("/v1/sinks/q")).json()["batch"] == 3
    finally:
        await again.close()


async def test_a_storage_error_while_committing_is_a_503_not_a_500(onceflow: InProcess) -> None:
    a, b = await two_tasks(onceflow, "q")

    async def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    write_marker = onceflow.broker.coordinator.write_marker
    onceflow.broker.coordinator.write_marker = disk_full
    r = await onceflow.client.post("/v1/sinks/q/commit", json={"batch": 0, "members": members(a, b)})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert "No space left on device" in r.json()["error"]["message"]
    assert await committed(onceflow, "x") == []  # decided, but no marker reached the stream yet
    # once the disk recovers, the server's sweep finishes the logged decision without a restart
    onceflow.broker.coordinator.write_marker = write_marker
    await onceflow.broker.coordinator.expire()
    assert sorted(m["from"] for m in await committed(onceflow, "x")) == ["a", "b"]
    assert await committed(onceflow, "y") == [{"from": "b"}]


async def test_a_commit_record_that_cannot_be_written_decides_nothing(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The members record is the commit point: when it cannot be stored, the members stay open
    (the sweep must not carry out a decision that was never logged) and a retry commits them."""
    a, b = await two_tasks(onceflow, "q")
    coord = onceflow.broker.coordinator
    disk = Disk(monkeypatch)
    disk.fail(coord.log)  # the coordinator's log: the decision (members) record is its next write
    r = await onceflow.client.post("/v1/sinks/q/commit", json={"batch": 4, "members": members(a, b)})
    assert r.status_code == 503
    assert disk.failed
    disk.heal()
    await coord.expire()  # the sweep finishes logged decisions only
    assert await committed(onceflow, "x") == [] and await committed(onceflow, "y") == []
    assert (await onceflow.client.get("/v1/sinks/q")).json()["batch"] is None
    retry = await onceflow.client.post("/v1/sinks/q/commit", json={"batch": 4, "members": members(a, b)})
    assert retry.json()["status"] == "committed"
    assert sorted(m["from"] for m in await committed(onceflow, "x")) == ["a", "b"]


async def test_a_boundaries_scan_lets_other_tasks_run_after_each_of_its_reads(onceflow: InProcess) -> None:
    """``format=boundaries`` walks the whole range it is asked about, a read at a time (each one
    bounded: about 4 MiB, on the PostgreSQL store a query within its read_timeout): other tasks
    run after each of them, so one request never holds the event loop for a whole stream."""
    await make(onceflow, "long")
    for i in range(20):
        await append(onceflow, "long", [{"i": i, "pad": "x" * 100}])
    s = onceflow.broker.get("long")
    assert s is not None
    async with ticking() as ticks:
        before = ticks[0]
        scan: Any = onceflow.broker.boundaries(s, s.earliest, None, every=5)
        if inspect.isawaitable(scan):
            scan = await scan
        during = ticks[0] - before
    marks, end = scan
    assert end == s.tail and len(marks) == 3, (marks, end)  # after records 5, 10, 15; the end is none
    assert during >= 1, "the ticker did not run during the scan"
