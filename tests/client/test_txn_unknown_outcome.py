"""The transactional producer after a write whose outcome it never learned (fault 15 of DESIGN.md).

Every test runs a real broker in-process (``httpx.ASGITransport`` over the App) behind a transport
that lets chosen requests reach the server and then loses the answer: the server has stored the
append, the client sees only transport errors until its delivery timeout. The invariant: the next
transaction neither loses its data (a sequence the server already holds, answered as a duplicate)
nor publishes the data of the transaction the application aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess, ServerProcess
from helpers.txn import committed, make, uncommitted
from onceflow.client import (
    AbortRequiredError,
    CommitOutcomeUnknownError,
    Consumer,
    OnceflowError,
    OutcomeUnknownError,
    ProducerFencedError,
    Stream,
    TransactionalProducer,
    TransportError,
)
from onceflow.client.transactions import AsyncTransactionalProducer
from onceflow.testing import FaultProxy

BASE = "http://testserver"
Match = Callable[[httpx.Request], bool]


class LoseAnswers(httpx.AsyncBaseTransport):
    """Passes every request to the in-process server. For requests that ``lose`` matches, the
    server's answer is read and then thrown away: the client gets a transport error instead, as
    after a connection dropped between the server's write and its answer. ``hold`` matches
    requests that are kept back (not sent yet) and answered with a transport error at once; they
    reach the server only when ``release()`` is called, like a request stuck in the network.
    ``refuse`` matches requests that never reach the server (connection refused)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.lose: Match | None = None
        self.hold: Match | None = None
        self.refuse: Match | None = None
        self.held: list[httpx.Request] = []
        self.lost = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.hold is not None and self.hold(request):
            self.hold = None  # only the first one
            self.held.append(request)
            raise httpx.ReadTimeout("the request is stuck in the network", request=request)
        if self.refuse is not None and self.refuse(request):
            raise httpx.ConnectError("connection refused", request=request)
        if self.lose is not None and self.lose(request):
            resp = await self.inner.handle_async_request(request)
            await resp.aread()
            self.lost += 1
            raise httpx.ReadError("the connection dropped before the answer", request=request)
        return await self.inner.handle_async_request(request)

    async def release(self) -> list[int]:
        """Send the held requests now; their statuses."""
        out = []
        for request in self.held:
            resp = await self.inner.handle_async_request(request)
            await resp.aread()
            out.append(resp.status_code)
        self.held.clear()
        return out


def appends_to(stream: str) -> Match:
    return lambda r: r.method == "POST" and r.url.path == f"/v1/stream/{stream}"


@pytest.fixture
async def faults(onceflow: InProcess) -> AsyncIterator[LoseAnswers]:
    yield LoseAnswers(httpx.ASGITransport(app=onceflow.app))


@pytest.fixture
async def producer(faults: LoseAnswers) -> AsyncIterator[AsyncTransactionalProducer]:
    client = httpx.AsyncClient(transport=faults, base_url=BASE)
    # a short delivery timeout: the client gives up after a few lost answers
    p = AsyncTransactionalProducer(BASE, "t", client=client, delivery_timeout=0.2, retry_backoff=(0.01, 0.02))
    await p.init()
    yield p
    await p.close()
    await client.aclose()


async def lose_every_answer(faults: LoseAnswers, stream: str, work: Any) -> OnceflowError:
    """Run ``work`` (an awaitable that sends to ``stream``) while every answer from ``stream`` is
    lost; it must fail, and the server must have received it."""
    faults.lose = appends_to(stream)
    try:
        with pytest.raises(OnceflowError) as exc:
            await work
    finally:
        faults.lose = None
    assert faults.lost >= 1
    return exc.value


# ---------------------------------------------------------------------- (a) and (b) of issue 14


@pytest.mark.anyio
async def test_an_append_lost_before_abort_does_not_swallow_the_next_transaction(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """(a) The transaction's number is known; its second append is stored but never answered.
    After abort(), the next transaction must not reuse that append's sequence number (the server
    would answer 204 "duplicate", the commit would succeed, and the new data would be gone)."""
    await make(onceflow, "a")
    async with producer.transaction():
        await producer.append("a", {"n": "first"})
    await producer.append("a", {"n": "aborted, known"})
    await producer.flush()
    await producer.append("a", {"n": "aborted, answer lost"})
    await lose_every_answer(faults, "a", producer.flush())
    await producer.abort()
    async with producer.transaction():
        await producer.append("a", {"n": "next"})
    assert await committed(onceflow, "a") == [{"n": "first"}, {"n": "next"}]
    assert {"n": "aborted, answer lost"} in await uncommitted(onceflow, "a")  # it did reach the server


@pytest.mark.anyio
async def test_a_lost_first_append_is_aborted_not_published_by_the_next_commit(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """(b) The lost append was the transaction's first: the client never learned the
    transaction's number, so abort() has to reach the server some other way. The next commit must
    not publish the aborted data."""
    await make(onceflow, "b")
    await producer.append("b", {"n": "aborted"})
    await lose_every_answer(faults, "b", producer.flush())
    await producer.abort()
    async with producer.transaction():
        await producer.append("b", {"n": "next"})
    assert await committed(onceflow, "b") == [{"n": "next"}]
    assert {"n": "aborted"} in await uncommitted(onceflow, "b")


@pytest.mark.anyio
async def test_the_same_through_the_transaction_block(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """``transaction()`` aborts when its block raises: after a lost answer too."""
    await make(onceflow, "c")
    faults.lose = appends_to("c")
    with pytest.raises(OnceflowError):
        async with producer.transaction():
            await producer.append("c", {"n": "aborted"})
            await producer.flush()
    faults.lose = None
    assert {"n": "aborted"} in await uncommitted(onceflow, "c")
    async with producer.transaction():
        await producer.append("c", {"n": "next"})
    assert await committed(onceflow, "c") == [{"n": "next"}]


@pytest.mark.anyio
async def test_an_append_stuck_in_the_network_cannot_join_a_later_transaction(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """The first attempt of the transaction's first append is stuck in the network while the
    client gives up and aborts; it reaches the server only afterwards. It must not begin a
    transaction that the producer's next commit then publishes."""
    await make(onceflow, "d")
    faults.hold = appends_to("d")
    faults.refuse = appends_to("d")  # the retries never get through
    await producer.append("d", {"n": "aborted"})
    with pytest.raises(OnceflowError):
        await producer.flush()
    faults.refuse = None
    await producer.abort()
    assert len(faults.held) == 1
    assert await faults.release() == [403]  # the old epoch is fenced
    async with producer.transaction():
        await producer.append("d", {"n": "next"})
    assert await committed(onceflow, "d") == [{"n": "next"}]


# ---------------------------------------------------------------------- what the producer allows meanwhile


@pytest.mark.anyio
async def test_a_transaction_with_a_lost_append_refuses_to_commit_until_aborted(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    await make(onceflow, "e", "f")
    await producer.append("e", {"n": "kept"})
    await producer.flush()
    await producer.append("f", {"n": "lost"})
    err = await lose_every_answer(faults, "f", producer.flush())
    assert isinstance(err, OutcomeUnknownError) and err.code == "outcome_unknown"
    for attempt in (
        producer.commit(),
        producer.append("e", {"n": "more"}),
        producer.flush(),
        producer.send_offsets_to_transaction("g", {"e": "0000000000000000_0000000000000000"}),
    ):
        with pytest.raises(AbortRequiredError) as exc:
            await attempt
        assert exc.value.cause is err and "abort()" in exc.value.message
    assert await committed(onceflow, "e") == [] and await committed(onceflow, "f") == []
    epoch = producer.epoch
    await producer.abort()
    assert producer.epoch == epoch + 1  # the abort took a new epoch
    async with producer.transaction():
        await producer.append("e", {"n": "after"})
        await producer.append("f", {"n": "after"})
    assert await committed(onceflow, "e") == [{"n": "after"}]
    assert await committed(onceflow, "f") == [{"n": "after"}]


@pytest.mark.anyio
async def test_an_append_that_never_reached_the_server_is_aborted_in_the_same_epoch(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """Refused at connect on every attempt: known not stored. The transaction still cannot commit
    (its data is missing), but its sequences are known, so abort() needs no new epoch."""
    await make(onceflow, "g")
    await producer.append("g", {"n": "stored"})
    await producer.flush()
    faults.refuse = appends_to("g")
    await producer.append("g", {"n": "never sent"})
    with pytest.raises(TransportError) as exc:
        await producer.flush()
    faults.refuse = None
    assert not isinstance(exc.value, OutcomeUnknownError)
    with pytest.raises(AbortRequiredError):
        await producer.commit()
    epoch = producer.epoch
    await producer.abort()
    assert producer.epoch == epoch
    async with producer.transaction():
        await producer.append("g", {"n": "next"})
    assert await committed(onceflow, "g") == [{"n": "next"}]


@pytest.mark.parametrize("carried", [True, False], ids=["commit-on-the-last-append", "commit-request"])
@pytest.mark.anyio
async def test_a_commit_whose_answer_is_lost_is_reported_unknown_and_settled_by_commit_again(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer, carried: bool
) -> None:
    await make(onceflow, "h")
    await producer.append("h", {"n": 1})
    if not carried:
        await producer.flush()  # nothing left to carry the commit: POST /v1/txn/t/commit
    faults.lose = appends_to("h") if carried else (lambda r: r.url.path == "/v1/txn/t/commit")
    with pytest.raises(CommitOutcomeUnknownError) as exc:
        await producer.commit()
    faults.lose = None
    assert exc.value.txn == 1
    assert await committed(onceflow, "h") == [{"n": 1}]  # it did commit; the producer cannot know
    for attempt in (producer.abort(), producer.append("h", {"n": 2})):
        with pytest.raises(CommitOutcomeUnknownError, match="commit\\(\\) again"):
            await attempt
    with pytest.raises(CommitOutcomeUnknownError):
        async with producer.transaction():
            pytest.fail("a transaction began while the last commit's outcome was unknown")
    await producer.commit()  # the same request again: answered as committed
    assert producer.txn is None
    async with producer.transaction():
        await producer.append("h", {"n": 2})
    assert await committed(onceflow, "h") == [{"n": 1}, {"n": 2}]


@pytest.mark.anyio
async def test_a_commit_that_never_arrived_commits_when_sent_again(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """The first try's request is stuck in the network, its retries refused: unknown. The second
    commit() stores and commits it; the stuck request, arriving last, changes nothing."""
    await make(onceflow, "i")
    faults.hold = appends_to("i")
    faults.refuse = appends_to("i")
    await producer.append("i", {"n": 1})
    with pytest.raises(CommitOutcomeUnknownError):
        await producer.commit()
    faults.refuse = None
    assert await uncommitted(onceflow, "i") == []
    await producer.commit()
    assert await faults.release() == [204]  # a duplicate of the committed append
    assert await committed(onceflow, "i") == [{"n": 1}]


@pytest.mark.anyio
async def test_a_newer_instance_that_took_over_during_the_outage_is_not_fenced_by_the_abort(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    await make(onceflow, "j")
    await producer.append("j", {"by": "old"})
    await lose_every_answer(faults, "j", producer.flush())
    newer = AsyncTransactionalProducer(BASE, "t", client=onceflow.client)
    await newer.init()
    with pytest.raises(ProducerFencedError) as exc:
        await producer.abort()
    assert exc.value.current_epoch == newer.epoch
    with pytest.raises(ProducerFencedError):
        await producer.append("j", {"by": "old"})
    async with newer.transaction():
        await newer.append("j", {"by": "newer"})
    assert await committed(onceflow, "j") == [{"by": "newer"}]


@pytest.mark.anyio
async def test_an_abort_whose_new_epoch_answer_is_lost_takes_that_epoch_when_tried_again(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """The init of the epoch bump reaches the server but its answer is lost: the second abort()
    must recognise the epoch it began (same request id), not bump again and call itself fenced."""
    await make(onceflow, "k")
    await producer.append("k", {"n": "lost"})
    await lose_every_answer(faults, "k", producer.flush())
    epoch = producer.epoch
    faults.lose = lambda r: r.url.path == "/v1/txn/t/init"
    with pytest.raises(TransportError):
        await producer.abort()
    faults.lose = None
    await producer.abort()
    assert producer.epoch == epoch + 1
    async with producer.transaction():
        await producer.append("k", {"n": "next"})
    assert await committed(onceflow, "k") == [{"n": "next"}]


@pytest.mark.anyio
async def test_the_transaction_block_finishes_an_abort_that_failed(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    """The block's append is lost and so is the abort's new epoch (the server is unreachable):
    the block raises the append's error. The next ``transaction()`` aborts first."""
    await make(onceflow, "l")
    faults.lose = lambda r: appends_to("l")(r) or r.url.path == "/v1/txn/t/init"
    with pytest.raises(OutcomeUnknownError):
        async with producer.transaction():
            await producer.append("l", {"n": "lost"})
            await producer.flush()
    faults.lose = None
    async with producer.transaction():
        await producer.append("l", {"n": "next"})
    assert await committed(onceflow, "l") == [{"n": "next"}]


@pytest.mark.anyio
async def test_an_append_cancelled_while_under_way_counts_as_unknown(
    onceflow: InProcess, faults: LoseAnswers, producer: AsyncTransactionalProducer
) -> None:
    await make(onceflow, "m")
    stored = asyncio.Event()
    inner_handle = faults.handle_async_request

    async def slow_answer(request: httpx.Request) -> httpx.Response:
        resp = await inner_handle(request)
        if appends_to("m")(request):
            stored.set()
            await asyncio.Event().wait()  # the answer never comes
        return resp

    faults.handle_async_request = slow_answer  # type: ignore[method-assign]
    await producer.append("m", {"n": "cancelled"})
    flush = asyncio.ensure_future(producer.flush())
    await stored.wait()
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    faults.handle_async_request = inner_handle  # type: ignore[method-assign]
    with pytest.raises(AbortRequiredError):
        await producer.commit()
    await producer.abort()
    async with producer.transaction():
        await producer.append("m", {"n": "next"})
    assert await committed(onceflow, "m") == [{"n": "next"}]


# ---------------------------------------------------------------------- the blocking twin, over TCP


def test_the_blocking_producer_through_a_proxy_that_loses_answers(tmp_path: Path) -> None:
    """(a) and (b) with the blocking producer against a server process, the answers lost by a TCP
    proxy that forwards each request, reads the server's answer and closes the connection."""
    srv = ServerProcess(tmp_path / "data", "--log-level", "error")
    srv.start()
    proxy = FaultProxy(srv.port)
    proxy.start()
    try:
        for name in ("pa", "pb"):
            with Stream.connect(srv.url, name) as s:
                s.create("application/json")
        with TransactionalProducer(proxy.url, "blocking", delivery_timeout=0.3, retry_backoff=(0.01, 0.02)) as p:
            with p.transaction():
                p.append("pa", {"n": "first"})
            p.append("pa", {"n": "aborted, known"})
            p.flush()
            p.append("pa", {"n": "aborted, answer lost"})  # (a): the transaction's number is known
            proxy.drop_probability = 1.0
            with pytest.raises(OutcomeUnknownError):
                p.flush()
            proxy.drop_probability = 0.0
            p.abort()
            with p.transaction():
                p.append("pa", {"n": "next"})
            p.append("pb", {"n": "aborted"})  # (b): the transaction's first append
            proxy.drop_probability = 1.0
            with pytest.raises(OutcomeUnknownError), p.transaction():
                p.flush()
            proxy.drop_probability = 0.0
            with p.transaction():
                p.append("pb", {"n": "next"})
        assert proxy.responses_dropped >= 2
        with Stream.connect(srv.url, "pa") as s:
            assert list(s.messages()) == [{"n": "first"}, {"n": "next"}]
        with Stream.connect(srv.url, "pb") as s:
            assert list(s.messages()) == [{"n": "next"}]
    finally:
        proxy.stop()
        srv.kill()


def test_an_exactly_once_consumer_rewinds_to_the_committed_offsets_after_an_abort(tmp_path: Path) -> None:
    """Consume, transform, produce; one transaction's append is stored but its answers are lost.
    The application aborts and goes on: rewinding the consumer makes the next transaction read
    that input again, so the output holds every input message once, in order."""
    srv = ServerProcess(tmp_path / "data", "--log-level", "error")
    srv.start()
    proxy = FaultProxy(srv.port)
    proxy.start()
    try:
        for name in ("eo/in", "eo/out"):
            with Stream.connect(srv.url, name) as s:
                s.create("application/json")
        with Stream.connect(srv.url, "eo/in") as s:
            for i in range(0, 30, 5):
                s.append_many([{"i": j} for j in range(i, i + 5)])
        consumer = Consumer(
            srv.url, group="eo", streams=["eo/in"], delivery="exactly-once", live=None, max_read_bytes=1
        )
        aborted = 0
        with TransactionalProducer(proxy.url, "eo", delivery_timeout=0.3, retry_backoff=(0.01, 0.02)) as p:
            while batch := consumer.poll():
                try:
                    with p.transaction():
                        p.extend("eo/out", [{"i2": m.value["i"] * 2} for m in batch])
                        if not aborted:
                            proxy.drop_probability = 1.0
                            try:
                                p.flush()
                            finally:
                                proxy.drop_probability = 0.0
                        p.send_offsets_to_transaction("eo", consumer.positions())
                except OutcomeUnknownError:
                    aborted += 1
                    consumer.rewind()
        consumer.close()
        assert aborted == 1
        with Stream.connect(srv.url, "eo/out") as s:
            assert list(s.messages()) == [{"i2": i * 2} for i in range(30)]
    finally:
        proxy.stop()
        srv.kill()
