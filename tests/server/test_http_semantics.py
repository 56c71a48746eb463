"""Behaviour users rely on beyond the conformance suite: If-Match, duplicates, failures, restarts."""

from __future__ import annotations

import asyncio
import errno
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess, ServerProcess
from helpers.txn import T, Txn
from onceflow.storage import log as storage_log
from onceflow.storage.fs import File

S = "/v1/stream/"
JSON = {"content-type": "application/json"}


def producer(pid: str, seq: int, epoch: int = 0) -> dict[str, str]:
    return {**JSON, "producer-id": pid, "producer-epoch": str(epoch), "producer-seq": str(seq)}


@pytest.mark.anyio
async def test_if_match_appends_only_at_the_expected_tail(onceflow: InProcess) -> None:
    c = onceflow.client
    r = await c.put(S + "occ", headers=JSON)
    tail = r.headers["stream-next-offset"]
    r = await c.post(S + "occ", content=b'{"v":1}', headers={**JSON, "if-match": tail})
    assert r.status_code == 204
    new_tail = r.headers["stream-next-offset"]
    # a writer that read the old tail loses, and learns the current one
    r = await c.post(S + "occ", content=b'{"v":2}', headers={**JSON, "if-match": f'"{tail}"'})
    assert r.status_code == 412
    assert r.headers["stream-next-offset"] == new_tail
    assert r.json()["error"]["code"] == "tail_mismatch"
    r = await c.post(S + "occ", content=b'{"v":2}', headers={**JSON, "if-match": f'"{new_tail}"'})
    assert r.status_code == 204
    assert (await c.get(S + "occ?offset=-1")).json() == [{"v": 1}, {"v": 2}]


@pytest.mark.anyio
async def test_if_match_retry_of_an_idempotent_append_is_a_duplicate_not_a_conflict(onceflow: InProcess) -> None:
    c = onceflow.client
    tail = (await c.put(S + "occ2", headers=JSON)).headers["stream-next-offset"]
    r1 = await c.post(S + "occ2", content=b'{"v":1}', headers={**producer("w", 0), "if-match": tail})
    assert r1.status_code == 200
    r2 = await c.post(S + "occ2", content=b'{"v":1}', headers={**producer("w", 0), "if-match": tail})
    assert r2.status_code == 204
    assert r2.headers["stream-next-offset"] == r1.headers["stream-next-offset"]
    assert (await c.get(S + "occ2?offset=-1")).json() == [{"v": 1}]


@pytest.mark.anyio
async def test_duplicate_answers_with_the_original_offset(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "d", headers=JSON)
    first = await c.post(S + "d", content=b'{"n":0}', headers=producer("p", 0))
    await c.post(S + "d", content=b'{"n":1}', headers=producer("p", 1))
    retry = await c.post(S + "d", content=b'{"n":0}', headers=producer("p", 0))
    assert retry.status_code == 204
    assert retry.headers["stream-next-offset"] == first.headers["stream-next-offset"]
    assert retry.headers["producer-seq"] == "1"  # the highest accepted, per the protocol
    assert (await c.get(S + "d?offset=-1")).json() == [{"n": 0}, {"n": 1}]


@pytest.mark.anyio
async def test_failed_write_is_not_acknowledged_and_the_retry_is_accepted(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault 10: ENOSPC during an append: no ack, no partial record, fine once space returns."""
    c = onceflow.client
    await c.put(S + "full", headers=JSON)
    await c.post(S + "full", content=b'{"n":0}', headers=producer("p", 0))
    real = storage_log._write_all

    def no_space(f: File, data: bytes, at: int, sync: bool) -> None:
        real(f, data[: len(data) // 2], at, False)  # half the batch reaches the file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage_log, "_write_all", no_space)
    r = await c.post(S + "full", content=b'{"n":1}', headers=producer("p", 1))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert "No space" in r.json()["error"]["message"]
    assert (await c.get(S + "full?offset=-1")).json() == [{"n": 0}]
    monkeypatch.setattr(storage_log, "_write_all", real)
    r = await c.post(S + "full", content=b'{"n":1}', headers=producer("p", 1))
    assert r.status_code == 200
    assert (await c.get(S + "full?offset=-1")).json() == [{"n": 0}, {"n": 1}]
    # and the half-written bytes are gone from the log after recovery too
    await onceflow.broker.close()
    again = onceflow.reopen()
    again.open()
    s = again.get("full")
    assert s is not None
    assert [b.header.count for b in s.log.read(s.log.base, 1 << 20)] == [1, 1]
    await again.close()


@pytest.mark.anyio
async def test_a_retry_racing_the_original_waits_for_its_fsync(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dedup answer is given only once the original is durable (Pulsar #5218)."""
    c = onceflow.client
    await c.put(S + "race", headers=JSON)
    gate = threading.Event()
    entered = threading.Event()
    real = storage_log._write_all

    def slow(f: File, data: bytes, at: int, sync: bool) -> None:
        entered.set()
        gate.wait(10)
        real(f, data, at, sync)

    monkeypatch.setattr(storage_log, "_write_all", slow)
    original = asyncio.ensure_future(c.post(S + "race", content=b'{"n":0}', headers=producer("p", 0)))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    retry = asyncio.ensure_future(c.post(S + "race", content=b'{"n":0}', headers=producer("p", 0)))
    await asyncio.sleep(0.2)
    assert not retry.done(), "a duplicate was acknowledged before the original was durable"
    gate.set()
    r1, r2 = await original, await retry
    assert (r1.status_code, r2.status_code) == (200, 204)
    assert r1.headers["stream-next-offset"] == r2.headers["stream-next-offset"]
    assert (await c.get(S + "race?offset=-1")).json() == [{"n": 0}]


@pytest.mark.anyio
async def test_a_retry_of_a_failed_original_fails_too(onceflow: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    c = onceflow.client
    await c.put(S + "race2", headers=JSON)
    gate = threading.Event()
    entered = threading.Event()

    def failing(f: File, data: bytes, at: int, sync: bool) -> None:
        entered.set()
        gate.wait(10)
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(storage_log, "_write_all", failing)
    original = asyncio.ensure_future(c.post(S + "race2", content=b'{"n":0}', headers=producer("p", 0)))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    retry = asyncio.ensure_future(c.post(S + "race2", content=b'{"n":0}', headers=producer("p", 0)))
    await asyncio.sleep(0.1)
    gate.set()
    r1, r2 = await original, await retry
    assert (r1.status_code, r2.status_code) == (503, 503)
    assert (await c.get(S + "race2?offset=-1")).json() == []


@pytest.mark.anyio
async def test_expired_streams_disappear(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "ttl", headers={**JSON, "stream-ttl": "1"})
    assert (await c.head(S + "ttl")).headers["stream-ttl"] == "1"
    await asyncio.sleep(1.2)
    assert (await c.get(S + "ttl?offset=-1")).status_code == 404
    assert (await c.put(S + "ttl", headers=JSON)).status_code == 201


def _get_all(url: str) -> list[Any]:
    out: list[Any] = []
    offset = "-1"
    with httpx.Client(timeout=10) as c:
        while True:
            r = c.get(url, params={"offset": offset})
            assert r.status_code == 200
            out += r.json()
            offset = r.headers["stream-next-offset"]
            if r.headers.get("stream-up-to-date") == "true":
                return out


@pytest.mark.slow
def test_state_survives_sigterm_and_kill(server: ServerProcess) -> None:
    """Fault 12: committed offsets, producer state, closure and forks survive restarts."""
    u = server.url + S
    with httpx.Client(timeout=10) as c:
        assert c.put(u + "r", headers=JSON).status_code == 201
        for i in range(20):
            assert c.post(u + "r", content=f'{{"i":{i}}}', headers=producer("p", i)).status_code == 200
        tail = c.head(u + "r").headers["stream-next-offset"]
        assert c.put(u + "f", headers={"stream-forked-from": "/v1/stream/r"}).status_code == 201
        assert c.put(u + "done", headers=JSON, content=b'[{"x":1}]').status_code == 201
        assert c.post(u + "done", headers={**JSON, "stream-closed": "true"}).status_code == 204
    assert server.stop() == 0  # SIGTERM: clean shutdown
    server.start()
    with httpx.Client(timeout=10) as c:
        assert c.head(u + "r").headers["stream-next-offset"] == tail
        r = c.post(u + "r", content=b'{"i":19}', headers=producer("p", 19))
        assert r.status_code == 204  # still a duplicate after the restart
        assert c.post(u + "r", content=b'{"i":20}', headers=producer("p", 20)).status_code == 200
        assert c.head(u + "done").headers.get("stream-closed") == "true"
    server.kill()  # kill -9: no snapshot, recovery scans the log
    server.start()
    assert _get_all(u + "r") == [{"i": i} for i in range(21)]
    assert _get_all(u + "f") == [{"i": i} for i in range(20)]
    with httpx.Client(timeout=10) as c:
        assert c.post(u + "r", content=b'{"i":20}', headers=producer("p", 20)).status_code == 204
        assert c.post(u + "r", content=b'{"i":0}', headers=producer("p", 0, epoch=1)).status_code == 200
        assert c.post(u + "r", content=b'{"i":99}', headers=producer("p", 21, epoch=0)).status_code == 403
        r = c.post(u + "done", content=b'{"x":2}', headers=JSON)
        assert r.status_code == 409 and r.headers["stream-closed"] == "true"


@pytest.mark.slow
def test_serve_cli_prints_ready_line_and_help(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "serve", "--help"], capture_output=True, text=True, check=True
    )
    for flag in ("--data", "--host", "--port", "--fsync", "--long-poll-timeout"):
        assert flag in out.stdout
    srv = ServerProcess(tmp_path / "d")
    srv.start()
    try:
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(15) == 0
    finally:
        srv.kill()


@pytest.mark.anyio
async def test_a_request_that_overtook_its_predecessor_waits_for_it(onceflow: InProcess) -> None:
    """Per-(stream, producer) serialisation: seq 1 arriving before seq 0 is appended after it."""
    c = onceflow.client
    await c.put(S + "reorder", headers=JSON)
    second = asyncio.ensure_future(c.post(S + "reorder", content=b'{"n":1}', headers=producer("p", 1)))
    await asyncio.sleep(0.05)
    assert not second.done()  # waiting for seq 0 rather than answering 409
    first = await c.post(S + "reorder", content=b'{"n":0}', headers=producer("p", 0))
    r2 = await second
    assert (first.status_code, r2.status_code) == (200, 200)
    assert (await c.get(S + "reorder?offset=-1")).json() == [{"n": 0}, {"n": 1}]


@pytest.mark.anyio
async def test_a_real_gap_is_still_a_409_after_the_reorder_wait(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "gap", headers=JSON)
    assert (await c.post(S + "gap", content=b'{"n":0}', headers=producer("p", 0))).status_code == 200
    r = await c.post(S + "gap", content=b'{"n":3}', headers=producer("p", 3))  # seq 1 and 2 never come
    assert r.status_code == 409
    assert (r.headers["producer-expected-seq"], r.headers["producer-received-seq"]) == ("1", "3")
    far = await c.post(S + "gap", content=b'{"n":999}', headers=producer("p", 999))  # beyond the window: at once
    assert far.status_code == 409
    assert (await c.get(S + "gap?offset=-1")).json() == [{"n": 0}]


@pytest.mark.anyio
@pytest.mark.local_store
async def test_a_delete_that_could_not_be_stored_is_a_503_and_changes_nothing(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete whose move to the trash (or soft delete record) failed was answered 204 while the
    stream stayed on disk: a restart brought it back. It is a 503 now, and the stream stays served."""
    from onceflow.storage.fs import OsFileSystem

    c = onceflow.client
    await c.put(S + "keep", headers=JSON)
    await c.post(S + "keep", content=b'{"n":0}', headers=JSON)
    await c.put(S + "parent", headers=JSON)
    await c.put(S + "child", headers={**JSON, "stream-forked-from": "parent"})

    def no_space(self: OsFileSystem, *a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(OsFileSystem, "rename", no_space)
    monkeypatch.setattr(OsFileSystem, "replace_file", no_space)
    for name in ("keep", "parent"):  # a hard delete, and a soft one (the parent has a fork)
        r = await c.delete(S + name)
        assert r.status_code == 503, r.text
        assert (await c.head(S + name)).status_code == 200
    monkeypatch.undo()
    assert (await c.get(S + "keep?offset=-1")).json() == [{"n": 0}]
    assert (await c.delete(S + "keep")).status_code == 204
    assert (await c.head(S + "keep")).status_code == 404


@pytest.mark.anyio
async def test_an_append_racing_the_delete_of_its_stream_is_answered(onceflow: InProcess) -> None:
    """Found by the cluster simulator (seed 115179): a DELETE handled after an append was staged and
    before it was written released the stream's files, the log's writer stopped on the missing
    segment, and the append's request was never answered (until the server process ended). The
    append is now refused as not stored (the stream is gone either way: a retry gets a 404)."""
    c = onceflow.client
    assert (await c.put(S + "racing", headers=JSON)).status_code == 201
    append, delete = await asyncio.wait_for(
        asyncio.gather(c.post(S + "racing", content=b'{"n":0}', headers=JSON), c.delete(S + "racing")), 5
    )
    assert delete.status_code == 204, delete.text
    assert append.status_code in (204, 503), append.text
    assert (await c.post(S + "racing", content=b'{"n":0}', headers=JSON)).status_code == 404


@pytest.mark.local_store  # fails the local store's own writes
@pytest.mark.anyio
async def test_a_write_whose_outcome_the_store_cannot_learn_is_never_answered_as_refused(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, hole 2's class: when the store says a write's outcome is unknown (the PostgreSQL
    store after a lost answer to COMMIT), every request that wrote is answered 503 ``outcome_unknown``
    (or succeeded), on every path: never ``unavailable``, which clients read as "not stored", and
    never a 500. Here every durable step of the local store says the outcome is unknown."""
    from onceflow.storage.fs import OsFileSystem, OutcomeUnknown, _OsFile

    c = onceflow.client
    for name in ("s", "parent", "gone", "closing"):
        assert (await c.put(S + name, headers=JSON)).status_code == 201
    assert (await c.put(S + "child", headers={**JSON, "stream-forked-from": "parent"})).status_code == 201
    t = Txn(c, "tx")
    await t.init()

    def unknown(*a: object, **k: object) -> None:
        raise OutcomeUnknown("the answer to COMMIT was lost (injected)")

    for cls, names in ((_OsFile, ("sync",)), (OsFileSystem, ("rename", "replace_file", "sync_dir", "unlink"))):
        for n in names:
            monkeypatch.setattr(cls, n, unknown)
    requests: list[tuple[str, httpx.Response]] = [
        ("create", await c.put(S + "new", headers=JSON)),
        ("fork", await c.put(S + "fork2", headers={**JSON, "stream-forked-from": "s"})),
        ("append", await c.post(S + "s", content=b'{"n":0}', headers=JSON)),
        ("idempotent append", await c.post(S + "s", content=b'{"n":1}', headers=producer("p", 0))),
        ("close", await c.post(S + "closing", headers={**JSON, "stream-closed": "true"})),
        ("delete", await c.delete(S + "gone")),
        ("delete of a forked stream", await c.delete(S + "parent")),
        (
            "group offsets",
            await c.post("/v1/groups/g/offsets", json={"offsets": {"s": "0000000000000000_0000000000000000"}}),
        ),
        ("transactional append", await t.send("s", {"n": 2})),
        ("transaction init", await c.post(T + "tx2/init", json={})),
        (
            "subscription",
            await c.put(S + "__ds/subscriptions/s1", json={"type": "pull-wake", "pattern": "s", "wake_stream": "w"}),
        ),
    ]
    wrong = [
        (what, r.status_code, r.text[:200])
        for what, r in requests
        if r.status_code >= 300 and (r.status_code != 503 or r.json()["error"]["code"].lower() != "outcome_unknown")
    ]
    assert not wrong, wrong


@pytest.mark.anyio
async def test_stream_data_is_never_active_content_on_the_servers_origin(onceflow: InProcess) -> None:
    """Issue 28, item 7: a stream created as ``text/html`` (or SVG) whose data holds a ``<script>``
    ran it when opened in a browser, on the origin of the dashboard and the admin endpoints. Every
    read of a stream's data is sandboxed (``Content-Security-Policy: sandbox``: no script, a unique
    origin) and not sniffed into something else."""
    c = onceflow.client
    page = b"<html><script>fetch('/v1/streams')</script></html>"
    created = await c.put(S + "page", content=page, headers={"content-type": "text/html", "stream-closed": "true"})
    assert created.status_code == 201  # closed: the live reads below end at once
    tail = (await c.head(S + "page")).headers["stream-next-offset"]
    reads = {
        "catch-up": await c.get(S + "page", params={"offset": "-1"}),
        "records": await c.get(S + "page", params={"offset": "-1", "format": "records"}),
        "tail": await c.get(S + "page", params={"offset": "now"}),
        "long-poll": await c.get(S + "page", params={"offset": tail, "live": "long-poll"}),
    }
    async with c.stream("GET", S + "page", params={"offset": "-1", "live": "sse"}) as sse:
        reads["sse"] = sse
    assert reads["catch-up"].content == page
    for kind, r in reads.items():
        assert r.status_code in (200, 204), (kind, r.status_code)
        assert "sandbox" in r.headers.get("content-security-policy", ""), (kind, dict(r.headers))
        assert r.headers.get("x-content-type-options") == "nosniff", (kind, dict(r.headers))
