"""Forks (``Stream-Forked-From``) and the data they inherit: read_committed through a fork, and
``Stream-Fork-Sub-Offset`` copies.

A fork's read_committed view of its source's range is exactly the source's read_committed view: the
fork's last stable offset (LSO) stops at the source's open transactions before the fork point, its
live readers wake when the source's LSO moves, and a sub-offset fork never copies uncommitted or
aborted transactional data as plain data. In-process (ASGI), no sockets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess
from helpers.sse import SSERead
from helpers.txn import JSON, S, Txn
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig

pytestmark = pytest.mark.anyio
WAIT = 30.0  # upper bound for anything a test waits on; never a timing assertion


@pytest.fixture
async def patient(tmp_path: Path) -> AsyncIterator[InProcess]:
    """Like ``onceflow``, but live reads wait long: a live read that returns must have been woken."""
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=WAIT, sse_max_seconds=WAIT))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=2 * WAIT) as client:
        yield InProcess(broker, app, client, tmp_path / "data")
    await broker.close()


async def read(c: InProcess, name: str, offset: str = "-1", isolation: str = "read_committed") -> list[Any]:
    r = await c.client.get(S + name, params={"offset": offset, "isolation": isolation})
    assert r.status_code == 200, r.text
    return list(r.json())


async def head(c: InProcess, name: str) -> httpx.Response:
    r = await c.client.head(S + name)
    assert r.status_code == 200
    return r


async def listed(c: InProcess, name: str) -> dict[str, Any]:
    r = await c.client.get("/v1/streams", params={"prefix": name})
    entry: dict[str, Any] = next(s for s in r.json()["streams"] if s["name"] == name)
    return entry


async def fork(
    c: InProcess, name: str, source: str, offset: str | None = None, sub: int | None = None
) -> httpx.Response:
    h = {"stream-forked-from": S + source}
    if offset is not None:
        h["stream-fork-offset"] = offset
    if sub is not None:
        h["stream-fork-sub-offset"] = str(sub)
    return await c.client.put(S + name, headers=h)


async def parent_with_open_txn(c: InProcess) -> tuple[Txn, str]:
    """Stream ``p``: a plain message, then an open transaction's message. Returns the producer and
    the offset where the transaction's data begins (the parent's LSO)."""
    assert (await c.client.put(S + "p", headers=JSON)).status_code == 201
    assert (await c.client.post(S + "p", json=[{"plain": 1}], headers=JSON)).status_code == 204
    t = Txn(c.client, "t")
    await t.init()
    assert (await t.send("p", {"txn": 1})).status_code == 200
    lso = (await head(c, "p")).headers["stream-last-stable-offset"]
    assert lso != (await head(c, "p")).headers["stream-next-offset"]
    return t, lso


# ---------------------------------------------------------------------- read_committed through a fork


async def test_a_fork_taken_during_an_open_transaction_hides_it_until_it_commits(onceflow: InProcess) -> None:
    t, lso = await parent_with_open_txn(onceflow)
    assert (await fork(onceflow, "f", "p")).status_code == 201
    assert await read(onceflow, "p") == [{"plain": 1}]
    assert await read(onceflow, "f") == [{"plain": 1}]  # not the open transaction's message
    assert await read(onceflow, "f", isolation="read_uncommitted") == [{"plain": 1}, {"txn": 1}]
    fhead = await head(onceflow, "f")
    assert fhead.headers["stream-last-stable-offset"] == lso  # the parent's open transaction holds it
    assert (await listed(onceflow, "f"))["stable_offset"] == lso
    r = await onceflow.client.get(S + "f", params={"offset": "now"})
    assert r.headers["stream-next-offset"] == lso
    # the fork's own appends wait behind the parent's transaction too (the LSO is a prefix)
    assert (await onceflow.client.post(S + "f", json=[{"fork": 1}], headers=JSON)).status_code == 204
    assert await read(onceflow, "f") == [{"plain": 1}]
    assert (await t.end(commit=True)).status_code == 200
    assert await read(onceflow, "f") == [{"plain": 1}, {"txn": 1}, {"fork": 1}]
    fhead = await head(onceflow, "f")
    assert fhead.headers["stream-last-stable-offset"] == fhead.headers["stream-next-offset"]
    assert (await listed(onceflow, "f"))["stable_offset"] == fhead.headers["stream-next-offset"]


async def test_a_fork_never_shows_an_aborted_transaction_of_its_parent(onceflow: InProcess) -> None:
    t, lso = await parent_with_open_txn(onceflow)
    assert (await fork(onceflow, "f", "p")).status_code == 201
    assert (await t.end(commit=False)).status_code == 200
    assert await read(onceflow, "p") == [{"plain": 1}]
    assert await read(onceflow, "f") == [{"plain": 1}]
    fhead = await head(onceflow, "f")
    assert fhead.headers["stream-last-stable-offset"] == fhead.headers["stream-next-offset"]
    # reading from the offset where the aborted data begins skips it, as on the parent
    assert await read(onceflow, "f", offset=lso) == await read(onceflow, "p", offset=lso) == []


async def test_a_fork_at_an_offset_inside_the_open_transaction(onceflow: InProcess) -> None:
    t, lso = await parent_with_open_txn(onceflow)
    await t.send("p", {"txn": 2})
    middle = (
        await onceflow.client.get(S + "p", params={"offset": lso, "isolation": "read_uncommitted", "max_bytes": "1"})
    ).headers["stream-next-offset"]
    assert (await fork(onceflow, "f", "p", offset=middle)).status_code == 201
    assert await read(onceflow, "f", isolation="read_uncommitted") == [{"plain": 1}, {"txn": 1}]
    assert await read(onceflow, "f") == [{"plain": 1}]
    assert (await head(onceflow, "f")).headers["stream-last-stable-offset"] == lso
    assert (await t.end(commit=True)).status_code == 200
    assert await read(onceflow, "f") == [{"plain": 1}, {"txn": 1}]  # the fork point cuts the transaction
    assert await read(onceflow, "p") == [{"plain": 1}, {"txn": 1}, {"txn": 2}]


async def test_a_fork_of_a_fork_waits_for_its_grandparent_transaction(onceflow: InProcess) -> None:
    t, lso = await parent_with_open_txn(onceflow)
    assert (await fork(onceflow, "f1", "p")).status_code == 201
    assert (await onceflow.client.post(S + "f1", json=[{"f1": 1}], headers=JSON)).status_code == 204
    assert (await fork(onceflow, "f2", "f1")).status_code == 201
    for name in ("f1", "f2"):
        assert await read(onceflow, name) == [{"plain": 1}]
        assert (await head(onceflow, name)).headers["stream-last-stable-offset"] == lso
        assert (await listed(onceflow, name))["stable_offset"] == lso
    assert (await t.end(commit=True)).status_code == 200
    assert await read(onceflow, "f1") == await read(onceflow, "f2") == [{"plain": 1}, {"txn": 1}, {"f1": 1}]
    t2 = Txn(onceflow.client, "t")
    await t2.init()
    await t2.send("p", {"txn": "later"})  # after both forks' points: not theirs
    assert await read(onceflow, "f2") == [{"plain": 1}, {"txn": 1}, {"f1": 1}]
    f2 = await head(onceflow, "f2")
    assert f2.headers["stream-last-stable-offset"] == f2.headers["stream-next-offset"]


async def test_a_fork_survives_a_restart_with_the_parent_transaction_still_open(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "data")
    broker.open()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=App(broker)), base_url="http://t") as client:
        t, lso = await parent_with_open_txn(InProcess(broker, App(broker), client, tmp_path / "data"))
        assert (await fork(InProcess(broker, App(broker), client, tmp_path / "data"), "f", "p")).status_code == 201
    await broker.close()
    again = Broker(tmp_path / "data")
    again.open()
    await again.start()  # the transaction is still open: its producer may go on
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=App(again)), base_url="http://t") as client:
        c = InProcess(again, App(again), client, tmp_path / "data")
        assert await read(c, "f") == [{"plain": 1}]
        assert (await head(c, "f")).headers["stream-last-stable-offset"] == lso
        t.c = client
        assert (await t.end(commit=True)).status_code == 200
        assert await read(c, "f") == [{"plain": 1}, {"txn": 1}]
        f = await head(c, "f")
        assert f.headers["stream-last-stable-offset"] == f.headers["stream-next-offset"]
    await again.close()


# ---------------------------------------------------------------------- live reads through a fork


async def wait_until(cond: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not cond():
        assert loop.time() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_long_poll_on_the_fork_wakes_when_the_parent_transaction_commits(patient: InProcess) -> None:
    t, lso = await parent_with_open_txn(patient)
    assert (await fork(patient, "f", "p")).status_code == 201
    f = patient.broker.streams["f"]
    poll = asyncio.ensure_future(patient.client.get(S + "f", params={"offset": lso, "live": "long-poll"}))
    await wait_until(lambda: f.waiters or poll.done(), "the long-poll to wait")
    assert not poll.done(), f"the long-poll answered while the transaction was open: {(await poll).content!r}"
    assert (await t.end(commit=True)).status_code == 200
    r = await asyncio.wait_for(poll, WAIT)
    assert r.status_code == 200 and r.json() == [{"txn": 1}]
    assert r.headers["stream-next-offset"] == (await head(patient, "f")).headers["stream-next-offset"]


async def test_a_long_poll_on_a_fork_of_a_fork_wakes_when_the_transaction_aborts(patient: InProcess) -> None:
    t, lso = await parent_with_open_txn(patient)
    assert (await fork(patient, "f1", "p")).status_code == 201
    assert (await patient.client.post(S + "f1", json=[{"f1": 1}], headers=JSON)).status_code == 204
    assert (await fork(patient, "f2", "f1")).status_code == 201
    f2 = patient.broker.streams["f2"]
    poll = asyncio.ensure_future(patient.client.get(S + "f2", params={"offset": lso, "live": "long-poll"}))
    await wait_until(lambda: f2.waiters or poll.done(), "the long-poll to wait")
    assert not poll.done(), f"the long-poll answered while the transaction was open: {(await poll).content!r}"
    assert (await t.end(commit=False)).status_code == 200
    r = await asyncio.wait_for(poll, WAIT)
    assert r.status_code == 200 and r.json() == [{"f1": 1}]


async def test_sse_on_the_fork_delivers_the_parent_transaction_only_once_committed(patient: InProcess) -> None:
    t, lso = await parent_with_open_txn(patient)
    assert (await fork(patient, "f", "p")).status_code == 201
    sse = SSERead(patient.app, "f", "-1")
    try:
        assert json.loads(await sse.next("data")) == [{"plain": 1}]
        control = json.loads(await sse.next("control"))
        assert control["streamNextOffset"] == lso and control.get("upToDate") is True
        assert sse.events.empty()
        assert (await t.end(commit=True)).status_code == 200
        assert json.loads(await sse.next("data")) == [{"txn": 1}]
        control = json.loads(await sse.next("control"))
        assert control["streamNextOffset"] == (await head(patient, "f")).headers["stream-next-offset"]
    finally:
        await sse.close()


async def test_a_subscription_to_the_fork_wakes_when_the_parent_transaction_commits(onceflow: InProcess) -> None:
    c = onceflow.client
    t, lso = await parent_with_open_txn(onceflow)
    assert (await fork(onceflow, "events/f", "p")).status_code == 201
    assert (await c.put(S + "wake/pool", headers=JSON)).status_code == 201
    r = await c.put(
        S + "__ds/subscriptions/sub", json={"type": "pull-wake", "streams": ["events/f"], "wake_stream": "wake/pool"}
    )
    assert r.status_code == 201, r.text
    try:
        info = next(x for x in (await c.get(S + "__ds/subscriptions/sub")).json()["streams"] if x["path"] == "events/f")
        assert info["acked_offset"] == lso  # linked at its tail: the parent's LSO
        assert (
            await c.post(S + "__ds/subscriptions/sub/claim", json={"worker": "w"})
        ).status_code == 409  # nothing pending
        assert (await t.end(commit=True)).status_code == 200  # only the parent's log changes

        async def woken() -> bool:
            events = (await c.get(S + "wake/pool", params={"offset": "-1"})).json()
            return any(e.get("subscription_id") == "sub" and e["stream"] == "events/f" for e in events)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while not await woken():
            assert loop.time() < deadline, "the subscription to the fork was never woken"
            await asyncio.sleep(0.02)
        claim = (await c.post(S + "__ds/subscriptions/sub/claim", json={"worker": "w"})).json()
        f = next(x for x in claim["streams"] if x["path"] == "events/f")
        assert (
            f["has_pending"] is True
            and f["tail_offset"] == (await head(onceflow, "events/f")).headers["stream-next-offset"]
        )
    finally:
        await onceflow.app.subscriptions.close()


# ---------------------------------------------------------------------- Stream-Fork-Sub-Offset


async def test_a_sub_offset_fork_refuses_to_copy_an_open_transaction(onceflow: InProcess) -> None:
    t, lso = await parent_with_open_txn(onceflow)
    await t.send("p", {"txn": 2})  # a second batch, so the anchor batch is not the last one
    r = await fork(onceflow, "f", "p", offset=lso, sub=1)
    assert r.status_code == 409, r.text
    assert "transaction" in r.json()["error"]["message"]
    assert (await onceflow.client.head(S + "f")).status_code == 404  # nothing half-created
    assert (await t.end(commit=False)).status_code == 200
    r = await fork(onceflow, "f", "p", offset=lso, sub=1)
    assert r.status_code == 400, r.text
    assert "aborted" in r.json()["error"]["message"]
    assert (await onceflow.client.head(S + "f")).status_code == 404
    assert await read(onceflow, "p") == [{"plain": 1}]


async def test_a_sub_offset_fork_copies_a_committed_transaction(onceflow: InProcess) -> None:
    t, lso = await parent_with_open_txn(onceflow)
    assert (await onceflow.client.head(S + "p")).status_code == 200
    await onceflow.client.post(S + "p", json=[{"plain": 2}], headers=JSON)
    assert (await t.end(commit=True)).status_code == 200
    r = await fork(onceflow, "f", "p", offset=lso, sub=1)
    assert r.status_code == 201, r.text
    assert await read(onceflow, "f") == [{"plain": 1}, {"txn": 1}]
    assert await read(onceflow, "f", isolation="read_uncommitted") == [{"plain": 1}, {"txn": 1}]


async def test_a_sub_offset_fork_taken_before_an_abort_never_shows_the_aborted_data(onceflow: InProcess) -> None:
    """The reported bug: the open message was copied as plain data and stayed visible after the abort."""
    t, lso = await parent_with_open_txn(onceflow)
    r = await fork(onceflow, "f", "p", offset=lso, sub=1)
    if r.status_code == 201:  # (only the unfixed server gets here)
        await t.end(commit=False)
        assert await read(onceflow, "f") == [{"plain": 1}], "aborted data is visible through the fork"
    assert r.status_code == 409


# ---------------------------------------------------------------------- poison messages (issue 15, item 13)


POISON = [
    b"1e400",  # valid JSON, decodes to inf, cannot be encoded again
    b"-1E+999",
    b'{"n": 1e400, "m": [ -1e999 ]}',  # with whitespace: the text is compacted, not re-encoded
    b'["\\ud800"]',  # a lone surrogate escape: valid JSON, no UTF-8 form
    b'{"k": "\\udfff and more"}',
    b'{"a":1,"a":2}',  # duplicate keys: re-encoding would change the message
    b'"a,b],[{c\\"}"',  # commas, brackets and escapes inside a string
    b'{"x": [1, {"y": "]},"}], "z": "\\\\"}',
    b'"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 \\u00e9"',  # unicode, raw and escaped
    b"1.0",  # re-encoding keeps it, but 1.00 would become 1.0
    b"1.000",
    b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
]


def deep(depth: int) -> bytes:
    return b"[" * depth + b"0" + b"]" * depth


@pytest.mark.parametrize(
    "message", [*POISON, None], ids=[*(p[:24].decode("utf-8", "replace") for p in POISON), "deepest-accepted"]
)
async def test_a_sub_offset_fork_copies_any_message_an_append_accepted(
    onceflow: InProcess, message: bytes | None
) -> None:
    """Whatever JSON an append accepted, a sub-offset fork copies it byte for byte, or refuses with a 4xx."""
    assert (await onceflow.client.put(S + "src", headers=JSON)).status_code == 201
    if message is None:  # the deepest nesting an append accepts (it depends on the interpreter)
        assert (await onceflow.client.put(S + "probe", headers=JSON)).status_code == 201
        lo, hi = 1, 1 << 14  # 32 KiB at most: under the fixture's body limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            r = await onceflow.client.post(S + "probe", content=deep(mid), headers=JSON)
            assert r.status_code in (204, 400), r.text
            lo, hi = (mid, hi) if r.status_code == 204 else (lo, mid - 1)
        message = deep(lo - 1)  # one level more inside the array below
    body = b"[" + message + b"," + b'"second"]'
    r = await onceflow.client.post(S + "src", content=body, headers=JSON)
    assert r.status_code in (204, 400), r.text
    if r.status_code == 400:
        return  # refused at the door: nothing to fork
    whole = await onceflow.client.get(S + "src", params={"offset": "-1"})
    assert whole.status_code == 200
    r = await fork(onceflow, "f", "src", offset="0000000000000000_0000000000000000", sub=1)
    assert r.status_code in (201, 400, 409), r.text
    if r.status_code != 201:
        assert (await onceflow.client.head(S + "f")).status_code == 404  # nothing half-created
        return
    got = await onceflow.client.get(S + "f", params={"offset": "-1"})
    assert got.status_code == 200
    # the fork holds exactly the first message as the source stores it, byte for byte
    source_text, fork_text = whole.content, got.content
    assert fork_text.startswith(b"[") and fork_text.endswith(b"]") and source_text.startswith(fork_text[:-1] + b",")
    assert fork_text[:-1] + b',"second"]' == source_text
    if not message.startswith(b"[[[["):  # the test's own parser may not reach that deep
        assert json.loads(fork_text) == json.loads(source_text)[:1]
    r = await fork(onceflow, "f2", "src", offset="0000000000000000_0000000000000000", sub=2)
    assert r.status_code == 201, r.text
    assert (await onceflow.client.get(S + "f2", params={"offset": "-1"})).content == source_text
    r = await fork(onceflow, "f3", "src", offset="0000000000000000_0000000000000000", sub=3)
    assert r.status_code == 400 and "past the next message boundary" in r.text


async def test_json_nested_deeper_than_the_parser_reaches_is_a_400(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "deep", headers=JSON)).status_code == 201
    for body in (deep(10_000), b" " + deep(10_000)):
        r = await onceflow.client.post(S + "deep", content=body, headers=JSON)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        r = await onceflow.client.put(S + "deep-create", content=body, headers=JSON)
        assert r.status_code == 400 and (await onceflow.client.head(S + "deep-create")).status_code == 404
