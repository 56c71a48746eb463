"""What a client creates besides streams can be removed (issue 28, item 3): a consumer group
(``DELETE /v1/groups/<group>``), an idle transactional id (``DELETE /v1/txn/<id>``) and a sink
with its tasks' ids (``POST /v1/sinks/<sink>/reset``). Each removal is one coordinator record:
memory after a restart, and after a compaction and a restart, is memory before it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from helpers.servers import InProcess
from helpers.txn import JSON, S, T, Txn, after_restart
from onceflow.core.coordinator import Coordinator
from onceflow.server.app import App, AppConfig

pytestmark = pytest.mark.anyio


async def _fill(c: httpx.AsyncClient, name: str, body: bytes) -> str:
    assert (await c.put(S + name, headers=JSON)).status_code == 201
    r = await c.post(S + name, content=body, headers=JSON)
    assert r.status_code == 204, r.text
    return r.headers["stream-next-offset"]


def _state(coord: Coordinator) -> dict[str, Any]:
    return {
        "groups": {g: dict(o) for g, o in coord.groups.items()},
        "member_epochs": dict(coord.member_epochs),
        "txns": {
            t: (m.epoch, m.txn, m.status.value, {g: dict(o) for g, o in m.offsets.items()})
            for t, m in coord.txns.items()
        },
        "sinks": sorted(coord.sinks),
        "epoch_floor": coord.epoch_floor,
    }


async def _after_restart(onceflow: InProcess, *, compact: bool) -> dict[str, Any]:
    """The coordinator's state after a restart (after a compaction first, if ``compact``)."""
    coord = onceflow.broker.coordinator
    if compact:
        coord.compact_bytes = 0
        assert await coord.maybe_compact()
    return await after_restart(onceflow, lambda b: _state(b.coordinator))


@pytest.mark.parametrize("compact", [False, True], ids=["restart", "compaction"])
async def test_a_deleted_group_stays_deleted(onceflow: InProcess, compact: bool) -> None:
    """The group's offsets, its member epoch and what completed transactions carried for it go;
    other groups and a transaction's offsets for them stay."""
    c = onceflow.client
    end = await _fill(c, "s", b"[1,2,3]")
    r = await c.post("/v1/groups/g/offsets", json={"offsets": {"s": end}, "member_epoch": 3})
    assert r.status_code == 200, r.text
    t = Txn(c, "copier")
    await t.init()
    r = await c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"s": end}})
    assert r.status_code == 200, r.text
    r = await c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "kept", "offsets": {"s": end}})
    assert (await c.post(T + "copier/commit", json={"epoch": t.epoch, "txn": r.json()["txn"]})).status_code == 200

    r = await c.delete("/v1/groups/g")
    assert r.status_code == 204, r.text
    coord = onceflow.broker.coordinator
    assert "g" not in coord.groups and "g" not in coord.member_epochs and coord.groups["kept"] == {"s": end}
    assert (await c.get("/v1/groups/g/offsets")).json()["offsets"] == {}
    assert [g["group"] for g in (await c.get("/v1/groups")).json()["groups"]] == ["kept"]
    before = _state(coord)
    assert await _after_restart(onceflow, compact=compact) == before


async def test_deleting_a_group_that_does_not_exist_is_a_404(onceflow: InProcess) -> None:
    r = await onceflow.client.delete("/v1/groups/nobody")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


async def test_a_group_held_by_an_open_transaction_is_not_deleted(onceflow: InProcess) -> None:
    """Its offsets would come back with the commit: refused (409 ``in_use``), then deleted once
    the transaction ended."""
    c = onceflow.client
    end = await _fill(c, "s", b"[1]")
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": end}})).status_code == 200
    t = Txn(c, "copier")
    await t.init()
    r = await c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"s": end}})
    assert r.status_code == 200, r.text
    txn = r.json()["txn"]
    r = await c.delete("/v1/groups/g")
    assert r.status_code == 409 and r.json()["error"]["code"] == "in_use", r.text
    assert "1 transaction(s) not complete" in r.json()["error"]["message"]  # counted, not named
    assert (await c.post(T + "copier/abort", json={"epoch": t.epoch, "txn": txn})).status_code == 200
    assert (await c.delete("/v1/groups/g")).status_code == 204


@pytest.mark.parametrize("compact", [False, True], ids=["restart", "compaction"])
async def test_a_deleted_transactional_id_begins_again_above_its_old_epochs(onceflow: InProcess, compact: bool) -> None:
    """The streams keep the producer state of ``txn:<id>``: the id initialised again after its
    deletion (even after a restart or a compaction) must not begin at epoch 0, or its first
    append to a stream it wrote before would be refused as a zombie's."""
    c = onceflow.client
    assert (await c.put(S + "out", headers=JSON)).status_code == 201
    t = Txn(c, "copier")
    for _ in range(3):
        await t.init()
    assert t.epoch == 2
    assert (await t.send("out", {"n": 1})).status_code == 200
    assert (await t.end(True)).status_code == 200

    r = await c.delete(T + "copier")
    assert r.status_code == 204, r.text
    assert (await c.get(T + "copier")).status_code == 404
    assert (await c.delete(T + "copier")).json()["error"]["code"] == "unknown_transactional_id"
    # an old holder of the id is refused, not taken for the id's new holder
    assert (await t.send("out", {"n": "zombie"})).status_code == 404
    assert await _after_restart(onceflow, compact=compact) == {**_state(onceflow.broker.coordinator), "txns": {}}

    again = onceflow.reopen()
    again.open()
    await again.start()
    app = App(again, AppConfig(long_poll_timeout=0.3))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c2:
            t2 = Txn(c2, "copier")
            await t2.init()
            assert t2.epoch == 3
            r = await t2.send("out", {"n": 2})
            assert r.status_code == 200, r.text
            assert (await t2.end(True)).status_code == 200
            r = await c2.get(S + "out", params={"offset": "-1"})
            assert r.json() == [{"n": 1}, {"n": 2}]
    finally:
        again.begin_shutdown()
        await again.close()


async def test_a_transactional_id_with_an_open_transaction_is_not_deleted(onceflow: InProcess) -> None:
    c = onceflow.client
    assert (await c.put(S + "out", headers=JSON)).status_code == 201
    t = Txn(c, "copier")
    await t.init()
    assert (await t.send("out", {"n": 1})).status_code == 200
    r = await c.delete(T + "copier")
    assert r.status_code == 409 and r.json()["error"]["code"] == "in_use", r.text
    assert (await t.end(False)).status_code == 200
    assert (await c.delete(T + "copier")).status_code == 204
