"""Closing a stream does not move its tail (PROTOCOL.md section 5.3).

A close-only request (``Stream-Closed: true``, no body) answers with the tail it found, and every
offset the server reports afterwards agrees: append and close answers, ``HEAD``, catch-up reads,
long-poll and SSE control events, ``204``s, the ``/v1/streams`` listing, forks of the closed
stream, idempotent close retries and a restart. The close marker is stored in the log (the closed
state must be durable) but takes no offset space as clients see it. In-process (ASGI), no sockets.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from helpers.servers import InProcess
from helpers.sse import SSERead
from helpers.txn import JSON, S, Txn
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.storage.log import SNAPSHOT_NAME

pytestmark = pytest.mark.anyio
TEXT = {"content-type": "text/plain"}
CLOSE = {"stream-closed": "true"}
ZERO = "0000000000000000_0000000000000000"


async def reported_everywhere(c: InProcess, name: str, tail: str) -> None:
    """Every way a client learns the tail of closed stream ``name`` says ``tail``."""
    h = await c.client.head(S + name)
    assert h.status_code == 200 and h.headers["stream-closed"] == "true"
    assert h.headers["stream-next-offset"] == tail
    assert h.headers["stream-last-stable-offset"] == tail
    listed = (await c.client.get("/v1/streams", params={"prefix": name})).json()["streams"]
    entry = next(s for s in listed if s["name"] == name)
    assert entry["next_offset"] == entry["stable_offset"] == tail and entry["closed"] is True
    for isolation in ("read_committed", "read_uncommitted"):
        whole = await c.client.get(S + name, params={"offset": "-1", "isolation": isolation})
        assert whole.headers["stream-next-offset"] == tail and whole.headers["stream-closed"] == "true"
        assert whole.headers["stream-up-to-date"] == "true"
        at_tail = await c.client.get(S + name, params={"offset": tail, "isolation": isolation})
        assert at_tail.status_code == 200 and at_tail.headers["stream-next-offset"] == tail
        assert at_tail.headers["stream-closed"] == "true" and at_tail.content in (b"", b"[]")
        now = await c.client.get(S + name, params={"offset": "now", "isolation": isolation})
        assert now.headers["stream-next-offset"] == tail and now.headers["stream-closed"] == "true"
        poll = await c.client.get(S + name, params={"offset": tail, "live": "long-poll", "isolation": isolation})
        assert poll.status_code == 204 and poll.headers["stream-next-offset"] == tail
        assert poll.headers["stream-closed"] == "true"
        poll_all = await c.client.get(S + name, params={"offset": "-1", "live": "long-poll", "isolation": isolation})
        assert poll_all.headers["stream-next-offset"] == tail and poll_all.headers["stream-closed"] == "true"
    for start in ("-1", tail):
        sse = SSERead(c.app, name, start)
        try:
            control = json.loads(await sse.next("control"))
            assert control == {"streamNextOffset": tail, "streamClosed": True, "upToDate": True}
        finally:
            await sse.close()
    again = await c.client.post(S + name, headers=CLOSE)  # closing again: idempotent, same tail
    assert again.status_code == 204 and again.headers["stream-next-offset"] == tail
    refused = await c.client.post(S + name, content=b"x", headers=TEXT)
    assert refused.status_code == 409 and refused.headers["stream-next-offset"] == tail
    # a fork of the closed stream starts at the tail (and may name it explicitly)
    for fork, extra in ((f"{name}-fork", {}), (f"{name}-fork-at", {"stream-fork-offset": tail})):
        r = await c.client.put(S + fork, headers={"stream-forked-from": S + name, **extra})
        assert r.status_code in (200, 201) and r.headers["stream-next-offset"] == tail, r.text
        assert "stream-closed" not in r.headers  # a fork starts open


async def test_a_close_only_request_leaves_the_tail_where_it_was(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "s", headers=TEXT)).status_code == 201
    r = await onceflow.client.post(S + "s", content=b"hello", headers=TEXT)
    tail = r.headers["stream-next-offset"]
    r = await onceflow.client.post(S + "s", headers=CLOSE)
    assert r.status_code == 204 and r.headers["stream-closed"] == "true"
    assert r.headers["stream-next-offset"] == tail
    await reported_everywhere(onceflow, "s", tail)
    assert (await onceflow.client.get(S + "s", params={"offset": "-1"})).content == b"hello"


async def test_closing_an_empty_stream_leaves_it_at_the_start(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "e", headers=JSON)).status_code == 201
    r = await onceflow.client.post(S + "e", headers=CLOSE)
    assert r.status_code == 204 and r.headers["stream-next-offset"] == ZERO
    await reported_everywhere(onceflow, "e", ZERO)
    assert (await onceflow.client.get(S + "e", params={"offset": "-1"})).json() == []


async def test_a_stream_created_closed_has_its_initial_tail(onceflow: InProcess) -> None:
    r = await onceflow.client.put(S + "c0", headers={**TEXT, **CLOSE})
    assert r.status_code == 201 and r.headers["stream-next-offset"] == ZERO
    await reported_everywhere(onceflow, "c0", ZERO)
    r = await onceflow.client.put(S + "c1", content=b"all of it", headers={**TEXT, **CLOSE})
    assert r.status_code == 201
    tail = r.headers["stream-next-offset"]
    assert tail != ZERO
    await reported_everywhere(onceflow, "c1", tail)
    again = await onceflow.client.put(S + "c1", headers={**TEXT, **CLOSE})  # idempotent create
    assert again.status_code == 200 and again.headers["stream-next-offset"] == tail


async def test_a_final_append_with_close_moves_the_tail_by_its_data_only(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "f", headers=JSON)).status_code == 201
    r = await onceflow.client.post(S + "f", json=[{"last": True}], headers={**JSON, **CLOSE})
    assert r.status_code == 204
    tail = r.headers["stream-next-offset"]
    await reported_everywhere(onceflow, "f", tail)
    assert (await onceflow.client.get(S + "f", params={"offset": "-1"})).json() == [{"last": True}]


async def test_an_idempotent_close_and_its_retries_report_the_same_tail(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "p", headers=TEXT)).status_code == 201
    producer = {"producer-id": "w", "producer-epoch": "0"}
    r = await onceflow.client.post(S + "p", content=b"a", headers={**TEXT, **producer, "producer-seq": "0"})
    assert r.status_code == 200
    tail = r.headers["stream-next-offset"]
    close = {**producer, "producer-seq": "1", **CLOSE}
    r = await onceflow.client.post(S + "p", headers=close)
    assert r.status_code == 204 and r.headers["stream-next-offset"] == tail and r.headers["stream-closed"] == "true"
    for _ in range(2):  # the answer was lost: retried, maybe twice
        r = await onceflow.client.post(S + "p", headers=close)
        assert r.status_code == 204 and r.headers["stream-next-offset"] == tail and r.headers["stream-closed"] == "true"
    for seq, body in (("0", b"a"), ("2", b"b")):  # an old retry of an append, or a new one: the stream is closed
        r = await onceflow.client.post(S + "p", content=body, headers={**TEXT, **producer, "producer-seq": seq})
        assert r.status_code == 409 and r.headers["stream-next-offset"] == tail and r.headers["stream-closed"] == "true"
    await reported_everywhere(onceflow, "p", tail)


async def test_an_idempotent_final_append_and_close_retry_reports_its_end(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "q", headers=TEXT)).status_code == 201
    final = {"producer-id": "w", "producer-epoch": "0", "producer-seq": "0", **TEXT, **CLOSE}
    r = await onceflow.client.post(S + "q", content=b"last", headers=final)
    assert r.status_code == 200
    tail = r.headers["stream-next-offset"]
    r = await onceflow.client.post(S + "q", content=b"last", headers=final)
    assert r.status_code == 204 and r.headers["stream-next-offset"] == tail
    await reported_everywhere(onceflow, "q", tail)


async def test_a_transaction_that_ends_after_the_close_does_not_move_the_tail(onceflow: InProcess) -> None:
    """The transaction's marker lands after the close marker; its data, before it, is readable."""
    assert (await onceflow.client.put(S + "t", headers=JSON)).status_code == 201
    t = Txn(onceflow.client, "closer")
    await t.init()
    r = await t.send("t", {"n": 1})
    assert r.status_code == 200
    tail = r.headers["stream-next-offset"]
    r = await onceflow.client.post(S + "t", headers=CLOSE)
    assert r.status_code == 204 and r.headers["stream-next-offset"] == tail
    assert (await onceflow.client.get(S + "t", params={"offset": "-1"})).json() == []  # not yet committed
    assert (await t.end(commit=True)).status_code == 200
    await reported_everywhere(onceflow, "t", tail)
    assert (await onceflow.client.get(S + "t", params={"offset": "-1"})).json() == [{"n": 1}]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return tmp_path / "data"


async def served(data: Path) -> tuple[Broker, httpx.AsyncClient, InProcess]:
    broker = Broker(data)
    broker.open()
    await broker.start()
    app = App(broker, AppConfig(long_poll_timeout=0.3))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    return broker, client, InProcess(broker, app, client, data)


@pytest.mark.parametrize("snapshot", [True, False], ids=["from-snapshot", "from-a-scan"])
async def test_the_tail_of_a_closed_stream_survives_a_restart(data: Path, snapshot: bool) -> None:
    broker, client, c = await served(data)
    try:
        assert (await client.put(S + "r", headers=TEXT)).status_code == 201
        tail = (await client.post(S + "r", content=b"kept", headers=TEXT)).headers["stream-next-offset"]
        closed = {"producer-id": "w", "producer-epoch": "0", "producer-seq": "0", **CLOSE}
        assert (await client.post(S + "r", headers=closed)).headers["stream-next-offset"] == tail
        directory = broker.streams["r"].directory
    finally:
        await client.aclose()
        await broker.close()
    if not snapshot:
        (directory / SNAPSHOT_NAME).unlink()
    broker, client, c = await served(data)
    try:
        await reported_everywhere(c, "r", tail)
        r = await client.post(S + "r", headers=closed)  # the retry of the close, after the restart
        assert r.status_code == 204 and r.headers["stream-next-offset"] == tail
    finally:
        await client.aclose()
        await broker.close()


async def test_an_offset_past_the_close_marker_still_reads_as_the_end(onceflow: InProcess) -> None:
    """Before closing stopped moving the tail, clients were handed the offset after the close
    marker (a consumer group may still hold one): it reads as the end of the stream."""
    assert (await onceflow.client.put(S + "o", headers=TEXT)).status_code == 201
    tail = (await onceflow.client.post(S + "o", content=b"x", headers=TEXT)).headers["stream-next-offset"]
    await onceflow.client.post(S + "o", headers=CLOSE)
    old = onceflow.broker.streams["o"].log.durable.end.token()  # where the close marker ends
    assert old != tail
    r = await onceflow.client.get(S + "o", params={"offset": old})
    assert r.status_code == 200 and r.headers["stream-next-offset"] == tail and r.headers["stream-closed"] == "true"
    r = await onceflow.client.get(S + "o", params={"offset": old, "live": "long-poll"})
    assert r.status_code == 204 and r.headers["stream-next-offset"] == tail and r.headers["stream-closed"] == "true"


async def test_a_closed_fork_reports_its_own_tail(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "src", content=b"abc", headers=TEXT)).status_code == 201
    r = await onceflow.client.put(S + "fk", headers={"stream-forked-from": S + "src"})
    assert r.status_code == 201
    tail = (await onceflow.client.post(S + "fk", content=b"def", headers=TEXT)).headers["stream-next-offset"]
    r = await onceflow.client.post(S + "fk", headers=CLOSE)
    assert r.headers["stream-next-offset"] == tail
    await reported_everywhere(onceflow, "fk", tail)
    assert (await onceflow.client.get(S + "fk", params={"offset": "-1"})).content == b"abcdef"


async def test_a_live_sse_reader_at_the_tail_learns_of_the_close(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "live", headers=JSON)).status_code == 201
    tail = (await onceflow.client.post(S + "live", json=[{"n": 1}], headers=JSON)).headers["stream-next-offset"]
    sse = SSERead(onceflow.app, "live", tail)
    try:
        first = json.loads(await sse.next("control"))
        assert first["streamNextOffset"] == tail and "streamClosed" not in first
        assert (await onceflow.client.post(S + "live", headers=CLOSE)).headers["stream-next-offset"] == tail
        control = json.loads(await sse.next("control"))
        assert control == {"streamNextOffset": tail, "streamClosed": True, "upToDate": True}
    finally:
        await sse.close()
    assert sse.events.empty()  # no data event: the close carries none


async def test_a_fork_at_an_offset_past_the_close_marker_is_a_fork_at_the_tail(onceflow: InProcess) -> None:
    assert (await onceflow.client.put(S + "src", content=b"abc", headers=TEXT)).status_code == 201
    assert (await onceflow.client.post(S + "src", headers=CLOSE)).status_code == 204
    tail = (await onceflow.client.head(S + "src")).headers["stream-next-offset"]
    old = onceflow.broker.streams["src"].log.durable.end.token()
    assert old != tail
    for _ in range(2):  # the second is an idempotent re-create
        r = await onceflow.client.put(S + "fk", headers={"stream-forked-from": S + "src", "stream-fork-offset": old})
        assert r.status_code in (201, 200) and r.headers["stream-next-offset"] == tail, r.text
    r = await onceflow.client.put(S + "fk", headers={"stream-forked-from": S + "src", "stream-fork-offset": tail})
    assert r.status_code == 200


async def test_a_fork_made_past_the_close_marker_by_an_older_version_reads_its_own_data(data: Path) -> None:
    """Before closing stopped moving the tail, a fork of a closed stream began after its close
    marker, past the tail the source now reports. Its reads still reach its own data."""
    broker, client, c = await served(data)
    try:
        assert (await client.put(S + "src", content=b"abc", headers=TEXT)).status_code == 201
        assert (await client.post(S + "src", headers=CLOSE)).status_code == 204
        src = broker.streams["src"]
        final, old = src.tail, src.log.durable.end
        assert (await client.put(S + "fk", headers={"stream-forked-from": S + "src"})).status_code == 201
        fk = broker.streams["fk"]
        assert fk.log.base == final
        directory = fk.directory
    finally:
        await client.aclose()
        await broker.close()
    # move the fork's start to where an older version put it: after the close marker
    meta = json.loads((directory / "meta.json").read_text())
    meta["fork_offset"] = [old.offset, old.pos]
    (directory / "meta.json").write_text(json.dumps(meta))
    (seg,) = directory.glob("*.seg")
    seg.rename(directory / f"{old.pos:020d}-{old.offset:020d}.seg")
    (directory / SNAPSHOT_NAME).unlink()
    broker, client, c = await served(data)
    try:
        assert (await client.post(S + "fk", content=b"def", headers=TEXT)).status_code == 204
        for isolation in ("read_committed", "read_uncommitted"):
            r = await client.get(S + "fk", params={"offset": "-1", "isolation": isolation})
            assert r.content == b"abcdef"
        h = await client.head(S + "fk")
        assert h.headers["stream-last-stable-offset"] == h.headers["stream-next-offset"]
    finally:
        await client.aclose()
        await broker.close()
