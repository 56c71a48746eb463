"""SSE live reads: many readers of one stream share one read and one encoding of each event, and a
live read ends when its stream goes away, even when the stream is only soft-deleted (it has forks).
In-process (ASGI), no sockets."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from helpers.servers import InProcess
from helpers.sse import SSERead
from helpers.txn import JSON, S, Txn

pytestmark = pytest.mark.anyio
WAIT = 30.0  # upper bound for anything a test waits on; never a timing assertion


async def test_an_sse_read_ends_when_its_stream_is_deleted_while_it_has_forks(onceflow: InProcess) -> None:
    """Deleting a stream that has forks keeps its data for the forks (a soft delete). A live reader of
    it used to wake, find nothing, and go round again without ever yielding: the server's event loop
    spun on that one read and answered nothing else."""
    c = onceflow.client
    assert (await c.put(S + "src", headers=JSON)).status_code == 201
    assert (await c.post(S + "src", content=b'{"n":1}', headers=JSON)).status_code == 204
    assert (await c.put(S + "child", headers={**JSON, "stream-forked-from": S + "src"})).status_code == 201
    reader = SSERead(onceflow.app, "src", "-1")
    assert json.loads(await reader.next("data")) == [{"n": 1}]
    await reader.next("control")

    async def delete_then_ask() -> int:
        assert (await c.delete(S + "src")).status_code == 204
        return (await c.get(S + "child?offset=-1")).status_code

    # the loop must stay free: another request is answered and the live read finishes
    assert await asyncio.wait_for(delete_then_ask(), WAIT) == 200
    await asyncio.wait_for(reader.task, WAIT)


async def test_readers_of_one_stream_each_get_every_event_of_their_own_isolation(onceflow: InProcess) -> None:
    """Readers at the same place share one read and one encoding of each event: read_committed and
    read_uncommitted readers of a stream with an open transaction must still each see their own view,
    and a reader that starts later from the beginning gets what it missed."""
    c = onceflow.client
    assert (await c.put(S + "fan", headers=JSON)).status_code == 201
    committed = [SSERead(onceflow.app, "fan", "-1") for _ in range(10)]
    dirty = [SSERead(onceflow.app, "fan", "-1", "isolation=read_uncommitted") for _ in range(10)]
    for r in committed + dirty:
        await r.next("control")

    async def each(readers: list[SSERead]) -> list[list[object]]:
        """Each reader's next data event that holds messages."""
        out: list[list[object]] = []
        for r in readers:
            got: list[object] = []
            while not got:
                got = json.loads(await r.next("data"))
            out.append(got)
        return out

    assert (await c.post(S + "fan", content=b'{"m":1}', headers=JSON)).status_code == 204
    assert await each(committed + dirty) == [[{"m": 1}]] * 20
    t = Txn(c, "fan-t")
    await t.init()
    assert (await t.send("fan", {"t": 1})).status_code == 200
    assert await each(dirty) == [[{"t": 1}]] * 10
    assert (await t.end(True)).status_code == 200
    assert await each(committed) == [[{"t": 1}]] * 10  # the commit moved the LSO: they wake for it
    assert (await c.post(S + "fan", content=b'{"m":2}', headers=JSON)).status_code == 204
    assert await each(committed + dirty) == [[{"m": 2}]] * 20
    late = SSERead(onceflow.app, "fan", "-1")
    assert json.loads(await late.next("data")) == [{"m": 1}, {"t": 1}, {"m": 2}]
    for r in [*committed, *dirty, late]:
        await r.close()
    for r in committed + dirty:  # and nothing else came: no message twice, none of the other view
        assert all(kind == "control" for kind, data in _drain(r))


async def test_a_transaction_marker_sends_no_empty_data_event(onceflow: InProcess) -> None:
    """A transaction's end writes a marker, which holds no message. Readers that are past the
    transaction's data when its marker lands (read_uncommitted after a commit, read_committed after
    an abort, whose data they never see) used to get a data event of ``[]`` for it: a client calls
    its handler with an empty batch. The control event alone moves them past the marker, and it
    must come at once, not with the next keep-alive (made too far off to arrive here)."""
    onceflow.app.config = dataclasses.replace(onceflow.app.config, long_poll_timeout=3600.0)
    c = onceflow.client
    assert (await c.put(S + "mk", headers=JSON)).status_code == 201
    dirty = SSERead(onceflow.app, "mk", "-1", "isolation=read_uncommitted")
    clean = SSERead(onceflow.app, "mk", "-1")

    async def data_until_tail(r: SSERead) -> list[object]:
        """Every data event's messages, in order, until a control event names the stream's tail."""
        tail = (await c.head(S + "mk")).headers["stream-next-offset"]
        got: list[object] = []
        while True:
            kind, data = await asyncio.wait_for(r.events.get(), WAIT)
            if kind == "data":
                got.append(json.loads(data))
            elif json.loads(data)["streamNextOffset"] == tail:
                return got

    for r in (dirty, clean):
        assert await data_until_tail(r) == []
    t = Txn(c, "mk-t")
    await t.init()
    assert (await t.send("mk", {"t": 1})).status_code == 200
    assert await data_until_tail(dirty) == [[{"t": 1}]]
    assert (await t.end(True)).status_code == 200  # dirty: only the marker is new
    assert await data_until_tail(dirty) == []
    assert await data_until_tail(clean) == [[{"t": 1}]]
    await t.init()
    assert (await t.send("mk", {"t": 2})).status_code == 200
    assert await data_until_tail(dirty) == [[{"t": 2}]]
    assert (await t.end(False)).status_code == 200  # clean: the aborted data is left out, then the marker
    assert await data_until_tail(dirty) == []
    assert await data_until_tail(clean) == []
    for r in (dirty, clean):
        await r.close()


def _drain(r: SSERead) -> list[tuple[str, str]]:
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait())
    return out


async def test_control_events_name_each_streams_own_offset_at_the_same_byte_position(onceflow: InProcess) -> None:
    """Control events are shared between readers, also of different streams. Two streams can end
    at the same byte position with different record offsets (``[1,2]`` and ``[123]``): each
    reader's ``streamNextOffset`` must be its own stream's (a reader resumes from it)."""
    c = onceflow.client
    tails = {}
    for name, body in (("two", b"[1,2]"), ("one", b"[123]")):
        assert (await c.put(S + name, headers=JSON)).status_code == 201
        r = await c.post(S + name, content=body, headers=JSON)
        assert r.status_code == 204
        tails[name] = r.headers["stream-next-offset"]
    assert tails["two"] != tails["one"] and tails["two"].split("_")[1] == tails["one"].split("_")[1]
    for name in ("two", "one"):
        reader = SSERead(onceflow.app, name, "-1")
        await reader.next("data")
        assert json.loads(await reader.next("control"))["streamNextOffset"] == tails[name]
        await reader.close()


class _HeldSSERead(SSERead):
    """An SSE read whose next send can be held: ``hold()``, then ``held`` is set while the server
    is inside that send, until ``release()``."""

    def __init__(self, *args: str, **kw: str) -> None:
        self.gate: asyncio.Event | None = None
        self.holding = False
        self.held = asyncio.Event()
        super().__init__(*args, **kw)

    def hold(self) -> None:
        self.gate, self.holding = asyncio.Event(), True

    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()

    async def _send(self, msg: Any) -> None:
        if self.holding and self.gate is not None and msg["type"] == "http.response.body":
            self.holding = False
            self.held.set()
            await self.gate.wait()
        await super()._send(msg)


@pytest.mark.parametrize("what", ["close", "delete", "shutdown"])
async def test_an_sse_read_sees_what_happened_while_it_was_sending(onceflow: InProcess, what: str) -> None:
    """A close (which moves no offset), a delete or a shutdown that happens while a live reader is
    in the middle of sending events wakes no one: the reader must still see it before it waits,
    not a long-poll timeout later."""
    onceflow.app.config.long_poll_timeout = 3600.0
    onceflow.app.config.sse_max_seconds = 3600.0
    c = onceflow.client
    assert (await c.put(S + "held", headers=JSON)).status_code == 201
    reader = _HeldSSERead(onceflow.app, "held", "-1")
    await reader.next("control")
    reader.hold()
    assert (await c.post(S + "held", content=b"[1]", headers=JSON)).status_code == 204
    await asyncio.wait_for(reader.held.wait(), WAIT)  # the reader is sending that message's events
    if what == "close":
        r = await c.post(S + "held", headers={**JSON, "stream-closed": "true"})
        assert r.status_code == 204, r.text
    elif what == "delete":
        assert (await c.delete(S + "held")).status_code == 204
    else:
        onceflow.broker.begin_shutdown()
    reader.release()
    await asyncio.wait_for(reader.task, WAIT)  # the live read ended
    if what == "close":
        events = _drain(reader)
        assert json.loads(events[-1][1]).get("streamClosed") is True, events
