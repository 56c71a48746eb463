"""A stream deleted and created again under the same name starts with no consumer-group offsets.

Group offsets are kept by stream name. A group's offset into a stream that was deleted stayed in
the coordinator, so once a stream of that name was created again its consumers resumed at the old
offset: they silently skipped the new stream's first messages (the offset was a position of the
old one), and a commit of the new stream's real, smaller offset was refused as moving backwards.
Kafka drops a deleted topic's offsets; onceflow drops them when the name is taken again."""

from __future__ import annotations

import errno

import httpx
import pytest

from helpers.servers import InProcess
from helpers.txn import JSON, S

pytestmark = pytest.mark.anyio


async def _offsets(c: httpx.AsyncClient, group: str) -> dict[str, str]:
    r = await c.get(f"/v1/groups/{group}/offsets")
    assert r.status_code == 200, r.text
    offsets: dict[str, str] = r.json()["offsets"]
    return offsets


async def _fill(c: httpx.AsyncClient, name: str, body: bytes) -> str:
    assert (await c.put(S + name, headers=JSON)).status_code == 201
    r = await c.post(S + name, content=body, headers=JSON)
    assert r.status_code == 204, r.text
    return r.headers["stream-next-offset"]


async def test_a_stream_created_again_has_no_offsets_of_the_one_deleted(onceflow: InProcess) -> None:
    c = onceflow.client
    old_end = await _fill(c, "orders", b"[1,2,3,4,5]")
    other_end = await _fill(c, "refunds", b"[1]")
    r = await c.post("/v1/groups/billing/offsets", json={"offsets": {"orders": old_end, "refunds": other_end}})
    assert r.status_code == 200, r.text
    assert (await c.delete(S + "orders")).status_code == 204
    new_end = await _fill(c, "orders", b"[6]")  # created again: one message, at offset 0
    assert await _offsets(c, "billing") == {"refunds": other_end}  # nothing to skip the new message with
    # a consumer that starts from the beginning of the new stream commits its real offset: accepted
    r = await c.post("/v1/groups/billing/offsets", json={"offsets": {"orders": new_end}})
    assert r.status_code == 200, r.text
    assert await _offsets(c, "billing") == {"orders": new_end, "refunds": other_end}
    # a PUT that confirms an existing stream keeps its offsets
    assert (await c.put(S + "orders", headers=JSON)).status_code == 200
    assert await _offsets(c, "billing") == {"orders": new_end, "refunds": other_end}


async def test_the_dropped_offsets_stay_dropped_after_a_restart(onceflow: InProcess) -> None:
    c = onceflow.client
    old_end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": old_end}})).status_code == 200
    assert (await c.delete(S + "s")).status_code == 204
    await _fill(c, "s", b"[9]")
    onceflow.broker.begin_shutdown()
    await onceflow.broker.close()
    again = onceflow.reopen()
    again.open()
    await again.start()
    try:
        assert again.coordinator.groups.get("g", {}) == {}
    finally:
        again.begin_shutdown()
        await again.close()


async def test_a_create_whose_offsets_could_not_be_dropped_creates_nothing(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop is stored before the create: when it cannot be (a full disk), the create is answered
    503 and nothing is created, and a retry once the disk has room does both."""
    c = onceflow.client
    old_end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": old_end}})).status_code == 200
    assert (await c.delete(S + "s")).status_code == 204
    coord = onceflow.broker.coordinator
    forget = coord.forget_stream

    async def full_disk(stream: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(coord, "forget_stream", full_disk)
    r = await c.put(S + "s", headers=JSON)
    assert r.status_code == 503, r.text
    assert "could not be dropped" in r.json()["error"]["message"]
    assert (await c.head(S + "s")).status_code == 404
    assert await _offsets(c, "g") == {"s": old_end}
    monkeypatch.setattr(coord, "forget_stream", forget)
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    assert await _offsets(c, "g") == {}
