"""The exactly-once sink's protocol, in process (no Spark): ``/v1/sinks/<id>`` and ``onceflow.spark._protocol``.

Each test names the hole it closes (issue 14) or the suspicion it proves or disproves.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conftest import InProcess
from test_transactions import S, Txn, committed, make

pytestmark = pytest.mark.anyio


def members(*ts: Txn) -> list[dict[str, Any]]:
    return [{"id": t.tid, "epoch": t.epoch, "txn": t.txn} for t in ts]


async def open_tasks(c: InProcess, sink: str, n: int = 2, stream: str = "out") -> list[Txn]:
    """``n`` task transactions under ``spark/<sink>/``, each with one row written and left open."""
    await make(c, stream)
    tasks = []
    for p in range(n):
        t = Txn(c.client, f"spark/{sink}/p{p}/a0")
        await t.init()
        assert (await t.send(stream, {"p": p})).status_code == 200
        tasks.append(t)
    return tasks


# ---------------------------------------------------------------------- 1. a retried commit


async def test_a_retried_commit_of_a_batch_write_is_answered_committed(onceflow: InProcess) -> None:
    """A batch (non-streaming) write has no batch id: its driver's commit, retried after a lost
    answer, must be told its own decision committed, not get a 409 that fails the job."""
    tasks = await open_tasks(onceflow, "batch-1a2b")
    body = {"members": members(*tasks), "abort_prefix": "spark/batch-1a2b/"}
    first = await onceflow.client.post("/v1/sinks/batch-1a2b/commit", json=body)
    assert first.json()["status"] == "committed"
    retry = await onceflow.client.post("/v1/sinks/batch-1a2b/commit", json=body)  # the answer was lost
    assert retry.status_code == 200, retry.text
    assert retry.json()["status"] == "committed"
    assert sorted(m["p"] for m in await committed(onceflow, "out")) == [0, 1]


async def test_a_retried_commit_of_a_streaming_batch_is_answered_committed(onceflow: InProcess) -> None:
    tasks = await open_tasks(onceflow, "q")
    body = {"batch": 3, "members": members(*tasks), "abort_prefix": "spark/q/"}
    assert (await onceflow.client.post("/v1/sinks/q/commit", json=body)).json()["status"] == "committed"
    retry = await onceflow.client.post("/v1/sinks/q/commit", json=body)
    assert retry.json() == {"sink": "q", "status": "committed", "batch": 3}


async def test_anything_but_the_same_decision_is_still_refused_after_a_commit(onceflow: InProcess) -> None:
    """Only the very decision that committed is answered "committed" again: a subset, another
    epoch or another batch of the same members is not."""
    tasks = await open_tasks(onceflow, "batch-x", n=3)
    body = {"members": members(*tasks)}
    assert (await onceflow.client.post("/v1/sinks/batch-x/commit", json=body)).json()["status"] == "committed"
    subset = await onceflow.client.post("/v1/sinks/batch-x/commit", json={"members": members(*tasks[:2])})
    assert subset.status_code == 409, subset.text
    other_epoch = [dict(m, epoch=m["epoch"] + 1) for m in members(*tasks)]
    assert (await onceflow.client.post("/v1/sinks/batch-x/commit", json={"members": other_epoch})).status_code == 400
    with_batch = await onceflow.client.post("/v1/sinks/batch-x/commit", json={"batch": 0, **body})
    assert with_batch.status_code == 409, with_batch.text
    # another sink naming these (committed) members is refused as before
    elsewhere = await onceflow.client.post("/v1/sinks/other/commit", json=body)
    assert elsewhere.status_code == 409, elsewhere.text


# ---------------------------------------------------------------------- 3. one lock order


async def test_a_commit_and_an_abort_of_one_sink_at_once_do_not_deadlock(onceflow: InProcess) -> None:
    """A paused driver's abort and its replacement's commit of the same sink, at the same time:
    each names one task of the other's leftovers. Both must finish (a deadlock hangs them, every
    later init of those ids and every later commit of the sink)."""
    a, b = await open_tasks(onceflow, "q")
    coord = onceflow.broker.coordinator
    commit = coord.commit_members("q", 0, [(a.tid, a.epoch, a.txn)], "spark/q/")
    abort = coord.abort_members("q", [(b.tid, b.epoch, b.txn)], "spark/q/")
    await asyncio.wait_for(asyncio.gather(commit, abort), timeout=20)  # bounded: a deadlock fails here
    # the sink and the ids still work
    await asyncio.wait_for(a.init(), timeout=20)
    assert [m["p"] for m in await committed(onceflow, "out")] == [0]
    head = await onceflow.client.head(S + "out")
    assert head.headers["stream-last-stable-offset"] == head.headers["stream-next-offset"]
