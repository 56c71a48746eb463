"""The transaction tests' helpers: a minimal transactional producer over raw HTTP (``Txn``), stream
setup and reads (``make``, ``committed``, ``uncommitted``), and the recovery tests' crash tools: an
in-process broker that recovers like ``onceflow serve`` (``serve``), ``kill`` (kill -9, through
``Broker.crash``), and cutting or rewriting the coordinator log as a crash before its fsync would."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

from helpers.servers import InProcess
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.storage.batch import FLAG_JSON
from onceflow.storage.log import StreamLog
from onceflow.storage.position import Position

Record = dict[str, Any]
Seen = TypeVar("Seen")
S = "/v1/stream/"
T = "/v1/txn/"
JSON = {"content-type": "application/json"}


class Txn:
    """A minimal transactional producer over raw HTTP (the protocol extension, step by step)."""

    def __init__(self, client: httpx.AsyncClient, tid: str) -> None:
        self.c, self.tid = client, tid
        self.epoch = -1
        self.txn = 0
        self.seqs: dict[str, int] = {}

    async def init(self, timeout_ms: int | None = None) -> dict[str, Any]:
        r = await self.c.post(T + self.tid + "/init", json={"timeout_ms": timeout_ms} if timeout_ms else {})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        self.epoch, self.txn, self.seqs = body["epoch"], body["txn"], {}
        return body

    async def send(
        self, stream: str, value: Any, *, epoch: int | None = None, commit: int | None = None, seq: int | None = None
    ) -> httpx.Response:
        """One transactional append; ``commit``: as the last append of that transaction
        (``Transaction-Commit``); ``seq``: resend an earlier sequence number (a retry)."""
        seq = self.seqs.get(stream, 0) if seq is None else seq
        headers = {
            "producer-id": "txn:" + self.tid,
            "producer-epoch": str(self.epoch if epoch is None else epoch),
            "producer-seq": str(seq),
            "transaction-id": self.tid,
        }
        if commit is not None:
            headers["transaction-commit"] = str(commit)
        r = await self.c.post(S + stream, json=[value], headers=headers)
        if r.status_code in (200, 204):
            self.seqs[stream] = max(self.seqs.get(stream, 0), seq + 1)
            # every 200 names its transaction; a 204 duplicate of an ended transaction's append has none
            if r.status_code == 200 or "transaction-number" in r.headers:
                self.txn = int(r.headers["transaction-number"])
        return r

    async def end(self, commit: bool, *, txn: int | None = None, epoch: int | None = None) -> httpx.Response:
        return await self.c.post(
            T + self.tid + ("/commit" if commit else "/abort"),
            json={"epoch": self.epoch if epoch is None else epoch, "txn": self.txn if txn is None else txn},
        )


async def make(c: InProcess, *names: str) -> None:
    for n in names:
        assert (await c.client.put(S + n, headers=JSON)).status_code == 201


async def committed(c: InProcess, name: str) -> list[Any]:
    r = await c.client.get(S + name, params={"offset": "-1"})
    assert r.status_code == 200
    return list(r.json())


async def uncommitted(c: InProcess, name: str) -> list[Any]:
    r = await c.client.get(S + name, params={"offset": "-1", "isolation": "read_uncommitted"})
    return list(r.json())


@asynccontextmanager
async def serve(data: Path, *, recover: bool = True) -> AsyncIterator[InProcess]:
    """A broker on ``data`` (recovered as ``onceflow serve`` does before listening), in process."""
    broker = Broker(data, reorder_wait=2.0)
    broker.open()
    if recover:
        await broker.start()
    app = App(broker, AppConfig(long_poll_timeout=0.3))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        yield InProcess(broker, app, client, data)


async def after_restart(onceflow: InProcess, look: Callable[[Broker], Seen]) -> Seen:
    """What ``look`` sees of a broker started again on ``onceflow``'s store, once ``onceflow``'s
    broker closed as at a clean stop (its own client is of no use afterwards)."""
    onceflow.broker.begin_shutdown()
    await onceflow.broker.close()
    again = onceflow.reopen()
    again.open()
    await again.start()
    try:
        return look(again)
    finally:
        again.begin_shutdown()
        await again.close()


async def kill(broker: Broker) -> None:
    """kill -9, after everything staged reached the files: no flush, no snapshot, no COMPLETE sync."""
    await broker.crash()


def coordinator_records(data: Path) -> list[tuple[Position, bytes, Record]]:
    """(start, payload, record) of every batch of the coordinator log (one record each)."""
    log = StreamLog.open(data / "coordinator", Position(0, 0))
    try:
        out = []
        at = log.base
        while at != log.durable.end:
            for b in log.read(at, 1 << 20):
                (rec,) = json.loads(b"[" + b.payload[:-1] + b"]")
                out.append((b.start, b.payload, rec))
                at = b.end
        return out
    finally:
        log.close_files()


def lose_tail_from(data: Path, first_lost: Callable[[Record], bool]) -> list[Record]:
    """The coordinator log's fsync did not finish: cut it at the first record matching ``first_lost``.
    Returns the records lost (so a test can check it cut what it meant to)."""
    recs = coordinator_records(data)
    cut = next(i for i, (_, _, rec) in enumerate(recs) if first_lost(rec))
    (seg,) = sorted((data / "coordinator").glob("*.seg"))
    with open(seg, "r+b") as f:
        f.truncate(recs[cut][0].pos)
    (data / "coordinator" / "producers.snap").unlink(missing_ok=True)
    return [rec for _, _, rec in recs[cut:]]


def lose_records(data: Path, lost: Callable[[Record], bool]) -> list[Record]:
    """Rewrite the coordinator log without the records matching ``lost`` (anywhere in it)."""
    recs = coordinator_records(data)
    directory = data / "coordinator"
    shutil.rmtree(directory)
    log = StreamLog.open(directory, Position(0, 0))
    log.write_initial([(payload, 1, FLAG_JSON) for _, payload, rec in recs if not lost(rec)])
    log.close_files()
    (directory / "producers.snap").unlink(missing_ok=True)
    return [rec for _, _, rec in recs if lost(rec)]


def is_txn(tid: str, status: str, txn: int | None = None) -> Callable[[Record], bool]:
    return lambda r: r.get("tid") == tid and r["status"] == status and (txn is None or r["txn"] == txn)


async def assert_settled(c: InProcess, *names: str) -> None:
    """Nothing is left open: read_committed readers see up to the tail of every stream."""
    for n in names:
        head = await c.client.head(S + n)
        assert head.headers["stream-last-stable-offset"] == head.headers["stream-next-offset"], n


async def status(c: InProcess, tid: str) -> dict[str, Any]:
    r = await c.client.get("/v1/txn/" + tid)
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body
