"""The operator endpoints (docs/operations.md): listings of transactional ids, groups with lag and
sinks, the richer stream listing, an operator's abort of a hanging transaction, and group resets;
bad input is a 4xx that changes nothing, and under the guard each needs the ``admin`` scope.

The broker runs on a clock the tests move, so append times and how long a transaction has been
open are exact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess
from helpers.txn import JSON, S, Txn, committed, make, uncommitted
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import Guard, GuardConfig

pytestmark = pytest.mark.anyio


class Clock:
    """Wall clock and monotonic clock in one, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def c(tmp_path: Path, clock: Clock) -> AsyncIterator[InProcess]:
    broker = Broker(tmp_path / "data", clock=clock)
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        yield InProcess(broker, app, client, tmp_path / "data")
    await broker.close()


async def append(c: InProcess, stream: str, *values: Any) -> str:
    """A plain append of ``values`` as one batch; the stream's next offset after it."""
    r = await c.client.post(S + stream, json=list(values))
    assert r.status_code == 204, r.text
    return r.headers["stream-next-offset"]


async def hanging(c: InProcess, tid: str, stream: str, *values: Any) -> Txn:
    """A transaction of ``tid`` that wrote ``values`` to ``stream`` and was left open."""
    t = Txn(c.client, tid)
    await t.init(timeout_ms=3_600_000)
    for v in values:
        assert (await t.send(stream, v)).status_code == 200
    return t


def records(token: str) -> int:
    return int(token.split("_")[0])


# ---------------------------------------------------------------------- streams


async def test_the_stream_listing_says_what_an_operator_needs_of_each_stream(c: InProcess, clock: Clock) -> None:
    await make(c, "app/orders")
    await append(c, "app/orders", 1, 2, 3)
    await hanging(c, "app/t", "app/orders", "x")
    fork = await c.client.put(S + "app/fork", headers={**JSON, "stream-forked-from": "app/orders"})
    assert fork.status_code == 201, fork.text
    streams = {s["name"]: s for s in (await c.client.get("/v1/streams", params={"prefix": "app/"})).json()["streams"]}
    o = streams["app/orders"]
    assert o["messages"] == 4 and o["start_offset"] == "0000000000000000_0000000000000000"
    assert o["bytes"] == int(o["next_offset"].split("_")[1])
    assert o["open_transactions"] == 1 and o["producers"] == 1 and o["forked_from"] is None
    assert records(o["stable_offset"]) == 3 and records(o["next_offset"]) == 4
    assert o["created_ms"] == int(clock.now * 1000) and o["ttl_seconds"] is None and o["expires_at"] is None
    assert streams["app/fork"]["forked_from"] == "app/orders"


# ---------------------------------------------------------------------- transactions


async def test_transactions_are_listed_with_status_epoch_streams_and_open_age(c: InProcess, clock: Clock) -> None:
    await make(c, "a", "b")
    await hanging(c, "app/open", "a", 1)
    done = await hanging(c, "app/done", "b", 2)
    assert (await done.end(True)).status_code == 200
    await hanging(c, "other/open", "b", 3)
    clock.now += 5
    listed = (await c.client.get("/v1/txn", params={"prefix": "app/"})).json()["transactions"]
    assert [t["transactional_id"] for t in listed] == ["app/done", "app/open"]
    done_row, open_row = listed
    assert open_row["status"] == "ongoing" and open_row["open"] is True and open_row["open_ms"] == 5000
    assert open_row["streams"] == ["a"] and open_row["epoch"] == 0 and open_row["txn"] == 1
    assert open_row["timeout_ms"] == 3_600_000
    assert done_row["status"] == "complete_commit" and done_row["open"] is False and done_row["open_ms"] is None
    only_open = (await c.client.get("/v1/txn", params={"open": "true"})).json()["transactions"]
    assert [t["transactional_id"] for t in only_open] == ["app/open", "other/open"]
    one = (await c.client.get("/v1/txn/app/open")).json()
    assert one == {k: v for k, v in open_row.items() if k != "open_ms"}  # an answer that stays the same


async def test_an_operator_aborts_a_hanging_transaction_and_fences_its_producer(c: InProcess) -> None:
    """The transaction holds the stream's last stable offset; aborted by an operator, its data is
    never shown to read_committed readers, the LSO moves on, and its producer is refused (403)
    instead of going on in a transaction that lost its first part."""
    await make(c, "orders")
    await append(c, "orders", "before")
    t = await hanging(c, "copier", "orders", "t1", "t2")
    await append(c, "orders", "after")
    assert await committed(c, "orders") == ["before"]  # held back by the open transaction
    r = await c.client.post("/v1/txn/copier/force-abort", json={})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["aborted"] == {"epoch": t.epoch, "txn": 1}
    assert body["epoch"] == t.epoch + 1 and body["status"] == "empty" and body["open"] is False
    assert await committed(c, "orders") == ["before", "after"]
    assert await uncommitted(c, "orders") == ["before", "t1", "t2", "after"]
    late = await t.send("orders", "t3")
    assert late.status_code == 403 and late.json()["error"]["code"] == "stale_epoch"
    commit = await t.end(True)
    assert commit.status_code == 403
    assert await committed(c, "orders") == ["before", "after"]
    listed = (await c.client.get("/v1/streams")).json()["streams"][0]
    assert listed["stable_offset"] == listed["next_offset"] and listed["open_transactions"] == 0


async def test_an_aborted_transaction_s_group_offsets_never_take_effect(c: InProcess) -> None:
    await make(c, "in", "out")
    start = await append(c, "in", 1)
    end = await append(c, "in", 2)
    t = await hanging(c, "copy", "out", 1)
    r = await c.client.post(
        "/v1/txn/copy/offsets", json={"epoch": t.epoch, "txn": t.txn, "group": "g", "offsets": {"in": end}}
    )
    assert r.status_code == 200, r.text
    assert (await c.client.post("/v1/groups/g/offsets", json={"offsets": {"in": start}})).status_code == 200
    aborted = (await c.client.post("/v1/txn/copy/force-abort", json={})).json()
    assert aborted["groups"] == []  # the new epoch carries nothing
    assert (await c.client.get("/v1/groups/g/offsets")).json()["offsets"] == {"in": start}


async def test_an_abort_with_nothing_open_is_refused_and_says_so(c: InProcess) -> None:
    await make(c, "s")
    t = await hanging(c, "t", "s", 1)
    assert (await t.end(True)).status_code == 200
    before = (await c.client.get("/v1/txn/t")).json()
    r = await c.client.post("/v1/txn/t/force-abort", json={})
    assert r.status_code == 409 and r.json()["error"]["code"] == "txn_refused"
    assert "has no open transaction" in r.json()["error"]["message"]
    assert "nothing was aborted" in r.json()["error"]["message"]
    assert (await c.client.get("/v1/txn/t")).json() == before  # not fenced either
    assert (await t.send("s", 2)).status_code == 200  # its producer goes on


async def test_an_abort_that_names_another_transaction_changes_nothing(c: InProcess) -> None:
    await make(c, "s")
    t = await hanging(c, "t", "s", 1)
    for body in ({"epoch": t.epoch + 1}, {"txn": t.txn + 1}, {"epoch": t.epoch, "txn": 0}):
        r = await c.client.post("/v1/txn/t/force-abort", json=body)
        assert r.status_code == 409, (body, r.text)
        assert "nothing was aborted" in r.json()["error"]["message"]
    assert (await c.client.get("/v1/txn/t")).json()["status"] == "ongoing"
    r = await c.client.post("/v1/txn/t/force-abort", json={"epoch": t.epoch, "txn": t.txn})
    assert r.status_code == 200 and r.json()["epoch"] == t.epoch + 1


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/txn/never/force-abort", {}, 404),
        ("/v1/txn/t/force-abort", {"epoch": "0"}, 400),
        ("/v1/txn/t/force-abort", {"txn": -1}, 400),
        ("/v1/txn/t/force-abort", [1], 400),
        ("/v1/txn/t/bogus", {}, 404),
    ],
)
async def test_bad_aborts_are_refused_and_change_nothing(c: InProcess, path: str, body: Any, status: int) -> None:
    await make(c, "s")
    await hanging(c, "t", "s", 1)
    r = await c.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert (await c.client.get("/v1/txn/t")).json()["status"] == "ongoing"


async def test_a_bad_open_filter_is_a_400(c: InProcess) -> None:
    r = await c.client.get("/v1/txn", params={"open": "yes"})
    assert r.status_code == 400 and "open must be true or false" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- groups


async def test_groups_are_listed_with_lag_up_to_the_last_stable_offset(c: InProcess) -> None:
    """Lag counts messages from the committed offset to the LSO: what a read_committed consumer
    can read now; an open transaction's data past the LSO is not lag yet."""
    await make(c, "a", "b", "gone")
    first = await append(c, "a", 1, 2)
    await append(c, "a", 3, 4, 5)
    await hanging(c, "t", "a", 6, 7)
    b_end = await append(c, "b", 1)
    gone = await append(c, "gone", 1)
    offsets = {"a": first, "b": b_end, "gone": gone}
    assert (await c.client.post("/v1/groups/app/g/offsets", json={"offsets": offsets})).status_code == 200
    assert (await c.client.delete(S + "gone")).status_code == 204
    r = await c.client.post("/v1/groups/app/fenced/offsets", json={"offsets": {"b": b_end}, "member_epoch": 4})
    assert r.status_code == 200
    assert (await c.client.post("/v1/groups/zz/offsets", json={"offsets": {"b": b_end}})).status_code == 200
    groups = (await c.client.get("/v1/groups", params={"prefix": "app/"})).json()["groups"]
    assert [g["group"] for g in groups] == ["app/fenced", "app/g"]
    fenced, g = groups
    assert fenced["member_epoch"] == 4 and fenced["lag"] == 0
    assert g["lag"] == 3 and g["member_epoch"] is None
    rows = {s["stream"]: s for s in g["streams"]}
    assert rows["a"]["lag"] == 3 and rows["a"]["offset"] == first
    assert records(rows["a"]["stable_offset"]) == 5 and records(rows["a"]["next_offset"]) == 7
    a_stable = rows["a"]["stable_offset"]
    assert rows["a"]["lag_bytes"] == int(a_stable.split("_")[1]) - int(first.split("_")[1]) > 0
    assert rows["b"]["lag"] == 0 and rows["b"]["lag_bytes"] == 0
    assert rows["gone"]["lag"] is None and rows["gone"]["next_offset"] is None  # the stream was deleted


async def read_group_position(c: InProcess, group: str, stream: str) -> str:
    return str((await c.client.get(f"/v1/groups/{group}/offsets")).json()["offsets"][stream])


async def test_a_group_is_reset_to_earliest_latest_an_offset_and_a_time(c: InProcess, clock: Clock) -> None:
    await make(c, "s")
    t0 = int(clock.now * 1000)
    one = await append(c, "s", 1)
    clock.now += 60
    two = await append(c, "s", 2)
    clock.now += 60
    await append(c, "s", 3)
    await hanging(c, "t", "s", 4)  # holds the LSO: "latest" stops before it, so nothing of it is lost
    stable = (await c.client.get("/v1/streams")).json()["streams"][0]["stable_offset"]
    assert (await c.client.post("/v1/groups/g/offsets", json={"offsets": {"s": two}})).status_code == 200

    async def reset(body: dict[str, Any]) -> dict[str, Any]:
        r = await c.client.post("/v1/groups/g/reset", json=body)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    dry = await reset({"to": "earliest", "dry_run": True})
    assert dry["offsets"] == {"s": "0000000000000000_0000000000000000"} and dry["previous"] == {"s": two}
    assert await read_group_position(c, "g", "s") == two  # a dry run changes nothing
    done = await reset({"to": "earliest"})
    assert done["offsets"] == {"s": "0000000000000000_0000000000000000"} and done["previous"] == {"s": two}
    assert await read_group_position(c, "g", "s") == "0000000000000000_0000000000000000"
    assert (await reset({"to": "latest"}))["offsets"] == {"s": stable}
    assert (await reset({"to": "offsets", "offsets": {"s": one}}))["offsets"] == {"s": one}
    assert await read_group_position(c, "g", "s") == one  # backwards: a reset may rewind
    # times: the first batch appended at or after the time
    assert (await reset({"to": "time", "time_ms": t0 + 60_000}))["offsets"] == {"s": one}
    assert (await reset({"to": "time", "time_ms": t0 + 1}))["offsets"] == {"s": one}
    assert (await reset({"to": "time", "time_ms": t0 + 120_000}))["offsets"] == {"s": two}
    assert (await reset({"to": "time", "time_ms": 0}))["offsets"] == {"s": "0000000000000000_0000000000000000"}
    tail = (await c.client.get("/v1/streams")).json()["streams"][0]["next_offset"]
    assert (await reset({"to": "time", "time_ms": t0 + 10_000_000}))["offsets"] == {"s": tail}
    assert await read_group_position(c, "g", "s") == tail


async def test_a_reset_of_named_streams_leaves_the_others(c: InProcess) -> None:
    await make(c, "a", "b")
    a = await append(c, "a", 1)
    b = await append(c, "b", 1)
    assert (await c.client.post("/v1/groups/g/offsets", json={"offsets": {"a": a, "b": b}})).status_code == 200
    r = await c.client.post("/v1/groups/g/reset", json={"to": "earliest", "streams": ["a"]})
    assert r.json()["offsets"] == {"a": "0000000000000000_0000000000000000"}
    assert (await c.client.get("/v1/groups/g/offsets")).json()["offsets"] == {
        "a": "0000000000000000_0000000000000000",
        "b": b,
    }
    # a new group starts where the reset puts it
    r = await c.client.post("/v1/groups/fresh/reset", json={"to": "latest", "streams": ["b"]})
    assert r.status_code == 200 and r.json()["previous"] == {"b": None}
    assert (await c.client.get("/v1/groups/fresh/offsets")).json()["offsets"] == {"b": b}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({}, 400, '"to"'),
        ({"to": "yesterday"}, 400, '"to"'),
        ({"to": "earliest", "streams": "s"}, 400, '"streams"'),
        ({"to": "earliest", "streams": []}, 400, '"streams"'),
        ({"to": "earliest", "streams": ["nope"]}, 404, "no stream named 'nope'"),
        ({"to": "earliest", "dry_run": "yes"}, 400, "dry_run"),
        ({"to": "time"}, 400, "time_ms"),
        ({"to": "time", "time_ms": -5}, 400, "time_ms"),
        ({"to": "latest", "time_ms": 5}, 400, "time_ms"),
        ({"to": "offsets"}, 400, "offsets"),
        ({"to": "offsets", "offsets": {"s": "-1"}}, 400, "not an offset this server issued"),
        ({"to": "offsets", "offsets": {"s": "0000000000000001_0000000000000001"}}, 400, "not a record boundary"),
        ({"to": "offsets", "offsets": {"s": "0000000000000099_0000000000009999"}}, 400, "beyond the end"),
        ({"to": "offsets", "offsets": {"s": "0000000000000000_0000000000000000"}, "streams": ["s"]}, 400, "streams"),
    ],
)
async def test_bad_resets_are_refused_and_change_nothing(
    c: InProcess, body: dict[str, Any], status: int, says: str
) -> None:
    await make(c, "s")
    end = await append(c, "s", 1)
    assert (await c.client.post("/v1/groups/g/offsets", json={"offsets": {"s": end}})).status_code == 200
    r = await c.client.post("/v1/groups/g/reset", json=body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]
    assert (await c.client.get("/v1/groups/g/offsets")).json()["offsets"] == {"s": end}


async def test_a_reset_of_a_group_without_offsets_must_name_its_streams(c: InProcess) -> None:
    r = await c.client.post("/v1/groups/new/reset", json={"to": "earliest"})
    assert r.status_code == 400 and "no committed offsets" in r.json()["error"]["message"]
    assert (await c.client.get("/v1/groups")).json() == {"groups": []}
    r = await c.client.get("/v1/groups/g/reset")
    assert r.status_code == 405


async def test_after_retention_lag_earliest_and_times_count_what_is_kept(tmp_path: Path, clock: Clock) -> None:
    """Retention deleted the oldest segments: a group whose offset is in them is flagged, its lag
    counts only what can still be read; earliest is the first offset kept; a reset to a deleted
    offset is a 410 that names the earliest one, and changes nothing."""
    broker = Broker(tmp_path / "data", clock=clock, segment_bytes=600)
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        c = InProcess(broker, app, client, tmp_path / "data")
        r = await client.put(S + "r", headers={**JSON, "Stream-Retention-Bytes": "1200"})
        assert r.status_code == 201, r.text
        t0 = int(clock.now * 1000)
        offsets = []
        for i in range(40):
            clock.now += 1
            offsets.append(await append(c, "r", {"i": i, "pad": "x" * 60}))
        assert (await client.post("/v1/groups/g/offsets", json={"offsets": {"r": offsets[0]}})).status_code == 200
        assert (await broker.enforce_retention()).get("r", 0) > 0
        earliest = (await client.head(S + "r")).headers["stream-earliest-offset"]
        kept = 40 - records(earliest)
        assert 0 < kept < 39

        listed = (await client.get("/v1/streams")).json()["streams"][0]
        assert listed["start_offset"] == earliest and listed["messages"] == kept
        assert listed["retention_bytes"] == 1200 and listed["retention_seconds"] is None

        (row,) = (await client.get("/v1/groups")).json()["groups"][0]["streams"]
        assert row["offset_gone"] is True and row["lag"] == kept

        gone = await client.post("/v1/groups/g/reset", json={"to": "offsets", "offsets": {"r": offsets[0]}})
        assert gone.status_code == 410 and gone.json()["error"]["code"] == "offset_gone"
        assert earliest in gone.json()["error"]["message"]
        assert (await client.get("/v1/groups/g/offsets")).json()["offsets"] == {"r": offsets[0]}

        r = await client.post("/v1/groups/g/reset", json={"to": "earliest"})
        assert r.json()["offsets"] == {"r": earliest}
        (row,) = (await client.get("/v1/groups")).json()["groups"][0]["streams"]
        assert row["offset_gone"] is False and row["lag"] == kept
        r = await client.post("/v1/groups/g/reset", json={"to": "time", "time_ms": t0})  # before all that is kept
        assert r.json()["offsets"] == {"r": earliest}
        r = await client.post("/v1/groups/g/reset", json={"to": "time", "time_ms": t0 + 39_000})
        assert r.json()["offsets"] == {"r": offsets[37]}  # the 39th append, made at t0 + 39 s, starts there
    await broker.close()


# ---------------------------------------------------------------------- sinks


async def test_sinks_are_listed_with_last_batch_and_owner(c: InProcess) -> None:
    for sink, batch, query in (("app/k", 3, "Q1"), ("app/j", 0, None), ("other/k", 1, "Q2")):
        r = await c.client.post(f"/v1/sinks/{sink}/commit", json={"batch": batch, "members": [], "query": query})
        assert r.status_code == 200, r.text
    listed = (await c.client.get("/v1/sinks", params={"prefix": "app/"})).json()["sinks"]
    assert listed == [
        {"sink": "app/j", "batch": 0, "owner": None, "rows": None},
        {"sink": "app/k", "batch": 3, "owner": "Q1", "rows": None},
    ]
    r = await c.client.post("/v1/sinks/app/k/reset", json={"owner": "Q1"})
    assert r.status_code == 200
    assert [s["sink"] for s in (await c.client.get("/v1/sinks")).json()["sinks"]] == ["app/j", "other/k"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/groups/g/offsets", '{"offsets": {"s\\ud800": "%s"}}'),
        ("/v1/sinks/k/commit", '{"batch": 1, "members": [], "query": "q\\udc80"}'),
    ],
)
async def test_names_no_path_could_hold_are_refused_in_bodies(c: InProcess, path: str, body: str) -> None:
    """A JSON body's ``"\\ud800"`` is a lone surrogate, which no path can carry and nothing can
    print: kept, it made the listings unprintable (``onceflow groups --json`` died encoding it)."""
    await make(c, "s")
    end = await append(c, "s", 1)
    r = await c.client.post(path, content=body.replace("%s", end), headers=JSON)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    assert (await c.client.get("/v1/groups")).json()["groups"] == []
    assert (await c.client.get("/v1/sinks")).json()["sinks"] == []


# ---------------------------------------------------------------------- the guard


OPS = {"authorization": "Bearer ops"}
TENANT = {"authorization": "Bearer tenant"}
APP_OPS = {"authorization": "Bearer app-ops"}


@pytest.fixture
async def guarded(c: InProcess) -> AsyncIterator[httpx.AsyncClient]:
    config = GuardConfig.from_json(
        {
            "tokens": {
                "ops": [{"prefix": "", "scopes": ["read", "admin"]}],
                "tenant": [{"prefix": "", "scopes": ["read", "write"]}],
                "app-ops": [{"prefix": "app/", "scopes": ["read", "admin"]}],
            }
        }
    )
    guard = Guard(c.app, c.broker, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as client:
        yield client


async def test_the_operator_endpoints_need_the_admin_scope(c: InProcess, guarded: httpx.AsyncClient) -> None:
    await make(c, "app/s")
    end = await append(c, "app/s", 1)
    assert (await c.client.post("/v1/groups/app/g/offsets", json={"offsets": {"app/s": end}})).status_code == 200
    await hanging(c, "app/t", "app/s", 2)
    requests: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/v1/txn?prefix=app/", None),
        ("GET", "/v1/groups?prefix=app/", None),
        ("GET", "/v1/sinks?prefix=app/", None),
        ("POST", "/v1/groups/app/g/reset", {"to": "earliest", "dry_run": True}),
        ("POST", "/v1/sinks/app/k/reset", {"owner": None}),
        ("POST", "/v1/txn/app/t/force-abort", {"txn": 99}),  # refused by the app when allowed: nothing changes
    ]
    for method, path, body in requests:
        refused = await guarded.request(method, path, json=body, headers=TENANT)
        assert refused.status_code == 403 and "may not admin" in refused.json()["error"]["message"], path
        allowed = await guarded.request(method, path, json=body, headers=OPS)
        assert allowed.status_code in (200, 409), (path, allowed.text)
        allowed = await guarded.request(method, path, json=body, headers=APP_OPS)
        assert allowed.status_code in (200, 409), (path, allowed.text)
    for path in ("/v1/txn", "/v1/groups", "/v1/sinks", "/v1/txn?prefix=ap"):
        assert (await guarded.get(path, headers=APP_OPS)).status_code == 403, path
    # a commit that rewinds is an operator's act too; the tenant's plain commits are as before
    rewind = {"offsets": {"app/s": "0000000000000000_0000000000000000"}, "reset": True}
    refused = await guarded.post("/v1/groups/app/g/offsets", json=rewind, headers=TENANT)
    assert refused.status_code == 403 and "may not admin 'app/g'" in refused.json()["error"]["message"]
    assert (await c.client.get("/v1/groups/app/g/offsets")).json()["offsets"] == {"app/s": end}
    assert (await guarded.post("/v1/groups/app/g/offsets", json={"offsets": {"app/s": end}}, headers=TENANT)).is_success
    assert (await c.client.get("/v1/txn/app/t")).json()["status"] == "ongoing"


def test_a_guard_file_may_grant_admin_and_nothing_unknown() -> None:
    config = GuardConfig.from_json({"tokens": {"ops": [{"prefix": "", "scopes": ["admin"]}]}})
    assert config.tokens is not None and config.tokens["ops"][0].scopes == frozenset({"admin"})
    with pytest.raises(ValueError, match='"admin"'):
        GuardConfig.from_json({"tokens": {"ops": [{"prefix": "", "scopes": ["root"]}]}})


async def test_a_reset_by_time_that_retention_overtakes_is_410_not_500(
    c: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deletes the segment the time scan is reading (it lets other requests run between
    its steps): the answer is 410 offset_gone naming the earliest offset kept, as for a reset to a
    deleted offset, not a 404 that says nothing was there."""
    from onceflow.storage.log import OffsetGone
    from onceflow.storage.position import Position

    await make(c, "s")
    await append(c, "s", 1)

    async def overtaken(s: Any, time_ms: int, **_: Any) -> Position:
        raise OffsetGone(Position(0, 0), Position(5, 500))

    monkeypatch.setattr(c.broker, "position_at_time", overtaken)
    r = await c.client.post("/v1/groups/g/reset", json={"to": "time", "time_ms": 1, "streams": ["s"]})
    assert r.status_code == 410, r.text
    assert r.json()["error"]["code"] == "offset_gone" and Position(5, 500).token() in r.json()["error"]["message"]
