"""Fault tests for the idempotent producers: kill -9 of the server, lost acknowledgements, reordered
requests, fencing, epoch claims, closed streams and the producer's counters.

Every delivery test reads the stream back and checks that it holds each message exactly once and in
append order. Lost acks come from :mod:`onceflow.testing` (its ``FaultProxy``) (the server commits, the client never hears back);
reordering from the proxy's request jitter or from an in-process transport that holds chosen requests.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess, ServerProcess
from onceflow.client import (
    AsyncIdempotentProducer,
    AsyncStream,
    IdempotentProducer,
    OnceflowError,
    OutcomeUnknownError,
    ProducerFencedError,
    Stream,
    StreamClosedError,
    TransportError,
)
from onceflow.testing import FaultProxy

JSON = "application/json"
Hook = Callable[[httpx.Request, httpx.AsyncBaseTransport], Awaitable[httpx.Response]]


# ---------------------------------------------------------------------- helpers and fixtures


def read_all(base: str, name: str) -> list[Any]:
    with Stream.connect(base, name) as s:
        return list(s.messages())


def create_json_stream(base: str, name: str) -> None:
    with Stream.connect(base, name) as s:
        s.create(JSON)


def indices(messages: list[Any]) -> list[int]:
    return [m["i"] for m in messages]


def assert_exactly_once_in_order(messages: list[Any], n: int) -> None:
    got = indices(messages)
    if got != list(range(n)):
        seen = set(got)
        missing = [i for i in range(n) if i not in seen][:10]
        dupes = len(got) - len(seen)
        first_bad = next((k for k, v in enumerate(got) if v != k), None)
        pytest.fail(
            f"{len(got)} messages for {n}: missing (first 10) {missing}, {dupes} duplicates, first out of place at {first_bad}"
        )


def wait_until_settled(p: IdempotentProducer) -> None:
    """flush() raises at the first fatal reply; requests still out fail as their replies come back."""
    deadline = time.monotonic() + 20
    while p.in_flight_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.in_flight_count == 0


def append_until_refused(p: IdempotentProducer, values: list[Any], refusal: type[OnceflowError]) -> int:
    """Append ``values`` one by one; how many append() accepted. The first ``refusal`` can come back
    while they are still being appended (a loaded machine): from then on append() raises it, and what
    it accepted before is what the producer must report lost."""
    accepted = 0
    for v in values:
        try:
            p.append(v)
        except refusal:
            break
        accepted += 1
    assert accepted >= 1
    return accepted


@pytest.fixture(autouse=True)
def _no_producer_id_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Producers without producer_id must get a fresh random id (and epoch 0), whatever the environment says."""
    monkeypatch.delenv("ONCEFLOW_PRODUCER_ID", raising=False)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("faults") / "data")
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def make_proxy(shared_server: ServerProcess) -> Iterator[Callable[..., FaultProxy]]:
    """Start fault proxies in front of the shared server; all are stopped at teardown."""
    proxies: list[FaultProxy] = []

    def make(**kw: Any) -> FaultProxy:
        p = FaultProxy(shared_server.port, **kw)
        p.start()
        proxies.append(p)
        return p

    try:
        yield make
    finally:
        for p in proxies:
            p.stop()


class HookTransport(httpx.AsyncBaseTransport):
    """Passes each request to ``hook(request, inner)``, which may hold, reorder or inspect it."""

    def __init__(self, inner: httpx.AsyncBaseTransport, hook: Hook) -> None:
        self.inner = inner
        self.hook = hook

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.hook(request, self.inner)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _passthrough(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
    return await inner.handle_async_request(request)


@pytest.fixture
async def hooked(onceflow: InProcess) -> AsyncIterator[Callable[[Hook], httpx.AsyncClient]]:
    """Clients on the in-process server whose requests go through a hook; closed at teardown."""
    clients: list[httpx.AsyncClient] = []

    def make(hook: Hook = _passthrough) -> httpx.AsyncClient:
        c = httpx.AsyncClient(
            transport=HookTransport(httpx.ASGITransport(app=onceflow.app), hook), base_url="http://testserver"
        )
        clients.append(c)
        return c

    try:
        yield make
    finally:
        for c in clients:
            await c.aclose()


IN_PROCESS = "http://testserver"


async def inproc_create(onceflow: InProcess, name: str) -> AsyncStream:
    s = AsyncStream.connect(IN_PROCESS, name, client=onceflow.client)
    await s.create(JSON)
    return s


async def inproc_read(onceflow: InProcess, name: str) -> list[Any]:
    s = AsyncStream.connect(IN_PROCESS, name, client=onceflow.client)
    return [m async for m in s.messages()]


def producer_seq(request: httpx.Request) -> tuple[int, int] | None:
    """(epoch, seq) of an idempotent append, None for anything else."""
    if request.method != "POST" or "producer-seq" not in request.headers:
        return None
    return int(request.headers["producer-epoch"]), int(request.headers["producer-seq"])


# ---------------------------------------------------------------------- a. kill -9 under load


@pytest.mark.slow
def test_blocking_producer_rides_through_repeated_kill_9(tmp_path: Path) -> None:
    """100,000 messages, max_in_flight=5, while another thread SIGKILLs and restarts the server
    three times (at random points spread over the run, each while requests are in flight, with a
    random downtime): every message lands exactly once, in order."""
    n, kills_wanted = 100_000, 3
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)  # noqa: S311
    # --log-level error: a recovery warning (e.g. a torn tail truncated) printed before the ready line
    # would make ServerProcess.start() take the restart for a failure
    srv = ServerProcess(tmp_path / "data", "--log-level", "error")
    srv.start()
    stop = threading.Event()
    killer_done = threading.Event()
    kills: list[dict[str, int]] = []
    killer_errors: list[BaseException] = []
    producer: IdempotentProducer | None = None
    killer: threading.Thread | None = None

    # kill when the acknowledged count passes random points spread over the run, with requests out
    thresholds = sorted(int(n * (f + rng.uniform(-0.05, 0.05))) for f in (0.15, 0.45, 0.75))

    def kill_loop() -> None:
        assert producer is not None
        try:
            for threshold in thresholds:
                deadline = time.monotonic() + 30
                while producer.stats.acked < threshold or producer.in_flight_count == 0:
                    if stop.is_set():
                        return
                    if time.monotonic() > deadline:
                        raise AssertionError(f"no progress: {producer.stats.acked} acked, waiting for {threshold}")
                    time.sleep(0.001)
                kills.append(
                    {
                        "acked": producer.stats.acked,
                        "in_flight": producer.in_flight_count,
                        "appended": producer.stats.appended,
                    }
                )
                srv.kill()
                if stop.wait(rng.uniform(0.05, 0.4)):
                    return
                srv.start()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            killer_errors.append(exc)
        finally:
            killer_done.set()

    try:
        create_json_stream(srv.url, "kill9")
        producer = IdempotentProducer(
            srv.url,
            "kill9",
            max_in_flight=5,
            max_batch_bytes=16 * 1024,
            delivery_timeout=60.0,
            retry_backoff=(0.02, 0.5),
            request_timeout=10.0,
        )
        killer = threading.Thread(target=kill_loop, name="killer", daemon=True)
        killer.start()
        i = 0
        while i < n:
            if killer_done.is_set():
                step, pause = n - i, 0.0  # the kills are over: the rest at once
            elif i < n * 9 // 10:
                step, pause = 500, 0.01  # spread the appends over the kills
            else:
                step, pause = 1, 0.002  # trickle, so requests keep flowing until the last kill
            for j in range(i, min(n, i + step)):
                producer.append({"i": j})
            i = min(n, i + step)
            if pause:
                time.sleep(pause)
        producer.flush(timeout=90)
        assert killer_done.wait(60)
        assert not killer_errors, f"killer thread failed: {killer_errors!r}"
        stats = producer.stats
        assert len(kills) == kills_wanted, (seed, kills)
        assert all(k["in_flight"] > 0 for k in kills), (
            f"a kill landed while nothing was in flight: {kills} (seed {seed})"
        )
        assert all(k["acked"] >= t for k, t in zip(kills, thresholds, strict=True))
        assert kills[-1]["acked"] < n and kills[-1]["appended"] < n  # the last kill came while appending
        assert stats.acked == n and stats.failed == 0 and stats.appended == n
        assert stats.retries > 0, "the kills never reached the producer"
        assert producer.pending_count == 0 and producer.in_flight_count == 0
        producer.close()
        producer = None
        assert_exactly_once_in_order(read_all(srv.url, "kill9"), n)
    finally:
        stop.set()
        if killer is not None:
            killer.join(30)
        if producer is not None:
            producer.close(flush=False)
        srv.kill()


# ---------------------------------------------------------------------- b/d. lost acknowledgements


@pytest.mark.slow
def test_lost_acks_are_retried_and_recognised_as_duplicates(
    shared_server: ServerProcess, make_proxy: Callable[..., FaultProxy]
) -> None:
    n = 20_000
    create_json_stream(shared_server.url, "lost-acks")
    proxy = make_proxy(drop_probability=0.3, seed=11)
    producer = IdempotentProducer(
        proxy.url, "lost-acks", max_in_flight=5, max_batch_bytes=2048, retry_backoff=(0.01, 0.2), delivery_timeout=60.0
    )
    try:
        for i in range(n):
            producer.append({"i": i})
        producer.flush(timeout=60)
        stats = producer.stats
        assert producer.pending_count == 0 and producer.in_flight_count == 0
    finally:
        producer.close(flush=False)
    assert_exactly_once_in_order(read_all(shared_server.url, "lost-acks"), n)
    assert stats.acked == n and stats.failed == 0
    assert proxy.responses_dropped > 0, "the proxy dropped nothing"
    assert stats.duplicates > 0, "no retry of a lost ack was answered as a duplicate"
    # every POST went through the proxy; each lost ack caused exactly one retry; a duplicate is
    # only ever the answer to the retry of a dropped response
    assert stats.requests == proxy.matched
    assert stats.retries == proxy.responses_dropped
    assert stats.duplicates <= proxy.responses_dropped
    assert stats.batches_sent + proxy.responses_dropped + stats.gaps == stats.requests


@pytest.mark.slow
@pytest.mark.anyio
async def test_async_producer_lost_acks_are_retried_and_recognised_as_duplicates(
    shared_server: ServerProcess, make_proxy: Callable[..., FaultProxy]
) -> None:
    n = 5_000
    create_json_stream(shared_server.url, "lost-acks-async")
    proxy = make_proxy(drop_probability=0.3, seed=5)
    async with AsyncIdempotentProducer(
        proxy.url,
        "lost-acks-async",
        max_in_flight=5,
        max_batch_bytes=1024,
        retry_backoff=(0.01, 0.2),
        delivery_timeout=60.0,
    ) as producer:
        for i in range(n):
            producer.append({"i": i})
            if i % 500 == 0:
                await asyncio.sleep(0)  # let batches go out while appending
        await producer.flush(timeout=60)
        stats = producer.stats
    async with AsyncStream.connect(shared_server.url, "lost-acks-async") as s:
        assert_exactly_once_in_order([m async for m in s.messages()], n)
    assert stats.acked == n and stats.failed == 0
    assert proxy.responses_dropped > 0
    assert stats.duplicates > 0
    assert stats.requests == proxy.matched
    assert stats.retries == proxy.responses_dropped


@pytest.mark.slow
def test_lost_ack_of_every_third_post_with_delayed_responses(
    shared_server: ServerProcess, make_proxy: Callable[..., FaultProxy]
) -> None:
    """Deterministic drops (every 3rd POST) plus slow responses, with a blocking producer."""
    n = 3_000
    create_json_stream(shared_server.url, "every-third")
    proxy = make_proxy(drop_every=3, delay=0.002, delay_jitter=0.01)
    with IdempotentProducer(
        proxy.url, "every-third", max_in_flight=4, max_batch_bytes=512, retry_backoff=(0.01, 0.1), delivery_timeout=60.0
    ) as producer:
        for i in range(n):
            producer.append({"i": i})
        producer.flush(timeout=60)
    assert_exactly_once_in_order(read_all(shared_server.url, "every-third"), n)
    assert proxy.responses_dropped == proxy.matched // 3
    assert proxy.responses_delayed == proxy.matched - proxy.responses_dropped
    assert producer.stats.retries == proxy.responses_dropped
    assert producer.stats.duplicates > 0


@pytest.mark.slow
def test_without_idempotence_the_same_lost_acks_duplicate(
    shared_server: ServerProcess, make_proxy: Callable[..., FaultProxy]
) -> None:
    """The control for the tests above: idempotent=False (plain at-least-once) stores retried
    batches twice, which is exactly what Producer-Id/-Epoch/-Seq prevents."""
    n = 600
    create_json_stream(shared_server.url, "plain-dups")
    proxy = make_proxy(drop_every=3)
    with IdempotentProducer(
        proxy.url,
        "plain-dups",
        idempotent=False,
        max_in_flight=1,
        max_batch_bytes=256,
        retry_backoff=(0.01, 0.1),
        delivery_timeout=60.0,
    ) as producer:
        for i in range(n):
            producer.append({"i": i})
        producer.flush(timeout=60)
    stored = [m["i"] for m in read_all(shared_server.url, "plain-dups")]
    assert proxy.responses_dropped > 0
    assert sorted(set(stored)) == list(range(n))  # nothing lost...
    assert len(stored) > n  # ...but every lost acknowledgement became a duplicate


# ---------------------------------------------------------------------- c. 409 sequence gaps


@pytest.mark.anyio
async def test_gap_is_resolved_when_the_first_batch_arrives_last(
    onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient]
) -> None:
    """Seq 0 is held until seq 1 was refused with a 409 gap: the later batches wait and are resent,
    and the stream keeps the append order. (The server's own reorder wait is switched off so that
    the gap reaches the client at once.)"""
    onceflow.broker.reorder_wait = 0
    await inproc_create(onceflow, "gap")
    seq1_refused = asyncio.Event()
    statuses: list[tuple[int, int]] = []

    async def hook(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
        es = producer_seq(request)
        if es == (0, 0) and not seq1_refused.is_set():
            await asyncio.wait_for(seq1_refused.wait(), 10)
        resp = await inner.handle_async_request(request)
        if es is not None:
            statuses.append((es[1], resp.status_code))
            if es[1] == 1 and resp.status_code == 409:
                seq1_refused.set()
        return resp

    async with AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/gap",
        producer_id="gapper",
        epoch=0,
        max_in_flight=5,
        max_batch_bytes=16,
        client=hooked(hook),
    ) as p:
        for i in range(50):
            p.append({"i": i})
        await p.flush(timeout=20)
        stats = p.stats
    assert seq1_refused.is_set()
    assert stats.gaps >= 1 and stats.failed == 0 and stats.retries == 0
    assert (1, 409) in statuses and (1, 200) in statuses
    assert_exactly_once_in_order(await inproc_read(onceflow, "gap"), 50)


@pytest.mark.slow
def test_reordered_requests_over_tcp_keep_order(
    shared_server: ServerProcess, make_proxy: Callable[..., FaultProxy]
) -> None:
    """Random request jitter in the proxy makes batches overtake each other on their way to the server.
    The server's reorder wait absorbs most of it and the client's 409 handling the rest (stats.gaps
    may be 0 or more); the stream must keep the append order either way."""
    n = 4_000
    create_json_stream(shared_server.url, "reorder")
    proxy = make_proxy(request_jitter=0.02, seed=3)
    with IdempotentProducer(
        proxy.url, "reorder", max_in_flight=5, max_batch_bytes=256, retry_backoff=(0.01, 0.1), delivery_timeout=60.0
    ) as producer:
        for i in range(n):
            producer.append({"i": i})
        producer.flush(timeout=60)
    assert_exactly_once_in_order(read_all(shared_server.url, "reorder"), n)
    seqs = [seq for _, seq in proxy.forwarded_producer_seqs]
    overtaken = sum(1 for a, b in zip(seqs, seqs[1:], strict=False) if b < a)
    assert overtaken > 0, "no batch ever overtook another: the jitter did not reorder anything"
    assert producer.stats.failed == 0 and producer.stats.retries == 0
    assert producer.stats.batches_sent + producer.stats.gaps == producer.stats.requests


# ---------------------------------------------------------------------- c. fencing and epochs


@pytest.mark.slow
def test_fenced_producer_fails_flush_and_reports_every_lost_message(shared_server: ServerProcess) -> None:
    base = shared_server.url
    create_json_stream(base, "fence")
    failures: list[tuple[OnceflowError, int]] = []
    p = IdempotentProducer(
        base,
        "fence",
        producer_id="zombie",
        epoch=0,
        max_in_flight=3,
        max_batch_bytes=64,
        on_error=lambda e, k: failures.append((e, k)),
    )
    try:
        for i in range(10):
            p.append({"i": i})
        p.flush(timeout=20)
        assert not failures
        with Stream.connect(base, "fence") as s:  # a newer incarnation of the same producer id
            r = s.append({"new": 1}, producer=("zombie", 1, 0))
            assert not r.duplicate and r.producer_epoch == 1
        accepted = append_until_refused(p, [{"i": i} for i in range(10, 40)], ProducerFencedError)
        with pytest.raises(ProducerFencedError) as exc:
            p.flush(timeout=20)
        assert exc.value.status == 403 and exc.value.current_epoch == 1
        wait_until_settled(p)
        assert failures and all(isinstance(e, ProducerFencedError) for e, _ in failures)
        assert sum(k for _, k in failures) == accepted
        assert p.stats.failed == accepted and p.stats.acked == 10 and p.pending_count == 0
        with pytest.raises(ProducerFencedError):
            p.append({"i": 40})
        assert p.stats.appended == 10 + accepted
    finally:
        p.close()  # a failed producer closes without flushing
    assert read_all(base, "fence") == [{"i": i} for i in range(10)] + [{"new": 1}]


@pytest.mark.anyio
async def test_auto_claim_moves_past_the_servers_epoch(
    onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient]
) -> None:
    s = await inproc_create(onceflow, "claim")
    await s.append({"old": 5}, producer=("eph", 5, 0))
    url = f"{IN_PROCESS}/v1/stream/claim"

    # without auto_claim an ephemeral producer at epoch 0 is fenced
    failed: list[int] = []
    plain = AsyncIdempotentProducer(
        url, producer_id="eph", epoch=0, client=hooked(_passthrough), on_error=lambda e, k: failed.append(k)
    )
    await plain.start()
    try:
        plain.append({"i": -1})
        with pytest.raises(ProducerFencedError) as exc:
            await plain.flush(timeout=10)
        assert exc.value.current_epoch == 5 and failed == [1]
    finally:
        await plain.close()

    # with auto_claim it takes epoch 6 and delivers everything, pipelined
    async with AsyncIdempotentProducer(
        url,
        producer_id="eph",
        epoch=0,
        auto_claim=True,
        max_in_flight=5,
        max_batch_bytes=32,
        client=hooked(_passthrough),
    ) as p:
        for i in range(60):
            p.append({"i": i})
        await p.flush(timeout=20)
        assert p.epoch == 6
        assert p.stats.failed == 0 and p.stats.acked == 60
    msgs = await inproc_read(onceflow, "claim")
    assert msgs[0] == {"old": 5}
    assert_exactly_once_in_order(msgs[1:], 60)
    with pytest.raises(ProducerFencedError) as exc:  # the server moved on to epoch 6
        await s.append({"late": 1}, producer=("eph", 5, 1))
    assert exc.value.current_epoch == 6


@pytest.mark.anyio
async def test_auto_claim_does_not_resend_a_batch_that_may_have_been_stored(
    onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient]
) -> None:
    """Seq 0 of epoch 0 is stored but its answer is lost; before the retry, another holder of the
    producer id moves it to epoch 5. The retry's 403 must not make the producer claim epoch 6 and
    store seq 0 a second time: whether the first try landed is unknown, so it fails instead."""
    s = await inproc_create(onceflow, "claim-lost")
    answers_lost = 0

    async def hook(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
        nonlocal answers_lost
        resp = await inner.handle_async_request(request)
        if producer_seq(request) == (0, 0) and answers_lost == 0:
            await resp.aread()
            answers_lost += 1
            await s.append({"other": 5}, producer=("lost-claim", 5, 0))
            raise httpx.ReadError("the connection dropped before the answer", request=request)
        return resp

    failures: list[OnceflowError] = []
    p = AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/claim-lost",
        producer_id="lost-claim",
        epoch=0,
        auto_claim=True,
        retry_backoff=(0.01, 0.02),
        client=hooked(hook),
        on_error=lambda e, k: failures.append(e),
    )
    await p.start()
    try:
        p.append({"i": 0})
        with pytest.raises(ProducerFencedError, match="may have been stored"):
            await p.flush(timeout=10)
    finally:
        await p.close(flush=False)
    assert answers_lost == 1
    assert await inproc_read(onceflow, "claim-lost") == [{"i": 0}, {"other": 5}]
    assert len(failures) == 1 and p.epoch == 0


@pytest.mark.anyio
@pytest.mark.parametrize("stored", [True, False], ids=["answers-lost", "refused-at-connect"])
async def test_a_batch_given_up_is_reported_unknown_only_if_it_may_have_been_stored(
    onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient], stored: bool
) -> None:
    """After the delivery timeout a batch whose requests may have reached the server fails with
    OutcomeUnknownError (it may be in the stream); one that never got through (connection refused
    on every try) with a plain TransportError (it is not)."""
    await inproc_create(onceflow, "given-up")

    async def hook(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
        if producer_seq(request) is None:
            return await inner.handle_async_request(request)
        if not stored:
            raise httpx.ConnectError("connection refused", request=request)
        resp = await inner.handle_async_request(request)
        await resp.aread()
        raise httpx.ReadError("the connection dropped before the answer", request=request)

    failures: list[OnceflowError] = []
    p = AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/given-up",
        producer_id="given-up",
        epoch=0,
        delivery_timeout=0.2,
        retry_backoff=(0.01, 0.02),
        client=hooked(hook),
        on_error=lambda e, k: failures.append(e),
    )
    await p.start()
    try:
        p.append({"i": 0})
        with pytest.raises(TransportError) as exc:
            await p.flush(timeout=10)
    finally:
        await p.close(flush=False)
    assert isinstance(exc.value, OutcomeUnknownError) is stored
    assert [type(e) for e in failures] == [type(exc.value)]
    assert await inproc_read(onceflow, "given-up") == ([{"i": 0}] if stored else [])


@pytest.mark.slow
def test_auto_claim_blocking_producer_against_a_real_server(shared_server: ServerProcess) -> None:
    base = shared_server.url
    create_json_stream(base, "claim-real")
    with Stream.connect(base, "claim-real") as s:
        s.append({"old": 5}, producer=("eph-real", 5, 0))
    # five requests in flight: the late 403s answering epoch 0 must not break the claim
    with IdempotentProducer(
        base, "claim-real", producer_id="eph-real", epoch=0, auto_claim=True, max_in_flight=5, max_batch_bytes=32
    ) as p:
        for i in range(200):
            p.append({"i": i})
        p.flush(timeout=30)
        assert p.epoch == 6
    msgs = read_all(base, "claim-real")
    assert msgs[0] == {"old": 5}
    assert_exactly_once_in_order(msgs[1:], 200)


@pytest.mark.anyio
async def test_auto_claim_survives_a_slow_fence_reply_from_the_old_epoch(
    onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient]
) -> None:
    """Seq 0 and seq 1 both go out at epoch 0 and are fenced. Seq 0's 403 arrives first: the producer
    claims epoch 6, resends seq 0 and gets it acknowledged. Only then does seq 1's (old) 403 arrive. It
    answers a request of the abandoned epoch, so seq 1 must simply be resent at epoch 6."""
    s = await inproc_create(onceflow, "claim-race")
    await s.append({"old": 5}, producer=("racer", 5, 0))
    p: AsyncIdempotentProducer | None = None

    async def acked_in_epoch_6() -> None:
        while p is None or p.stats.acked < 1:
            await asyncio.sleep(0.001)

    seq1_sent_in_0 = asyncio.Event()

    async def hook(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
        es = producer_seq(request)
        if es == (0, 0):  # both go out in epoch 0 before either is answered
            await asyncio.wait_for(seq1_sent_in_0.wait(), 10)
        elif es == (0, 1):
            seq1_sent_in_0.set()
        resp = await inner.handle_async_request(request)
        if es == (0, 1):
            assert resp.status_code == 403
            await asyncio.wait_for(acked_in_epoch_6(), 10)  # seq 1's fence reply is slow
        return resp

    failures: list[OnceflowError] = []
    p = AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/claim-race",
        producer_id="racer",
        epoch=0,
        auto_claim=True,
        max_in_flight=2,
        max_batch_bytes=1,
        client=hooked(hook),
        on_error=lambda e, k: failures.append(e),
    )
    await p.start()
    try:
        p.append({"i": 0})
        p.append({"i": 1})
        await p.flush(timeout=20)
    finally:
        await p.close(flush=False)
    assert not failures
    assert p.epoch == 6
    msgs = await inproc_read(onceflow, "claim-race")
    assert msgs[0] == {"old": 5}
    assert_exactly_once_in_order(msgs[1:], 2)


@pytest.mark.anyio
async def test_auto_claim_does_not_claim_twice_on_a_late_fence_reply(
    onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient]
) -> None:
    """Seq 1's request of epoch 0 reaches the server after seq 0 was stored in the claimed epoch 6, so
    its 403 says "current epoch 6", and the producer hears of it before seq 0's 200. It must resend
    seq 1 in epoch 6, not claim epoch 7."""
    s = await inproc_create(onceflow, "claim-twice")
    await s.append({"old": 5}, producer=("twice", 5, 0))
    seq0_stored_in_6 = asyncio.Event()
    seq1_resent = asyncio.Event()
    epochs_of_seq1: list[int] = []

    seq1_sent_in_0 = asyncio.Event()

    async def hook(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
        es = producer_seq(request)
        await asyncio.sleep(0.001)  # a little latency: an in-process request may not yield at all, and the
        # buggy producer resends in a loop without backoff, which would starve flush's timeout
        if es == (0, 0):  # both go out in epoch 0 before either is answered
            await asyncio.wait_for(seq1_sent_in_0.wait(), 10)
        if es == (0, 1):
            seq1_sent_in_0.set()
            await asyncio.wait_for(seq0_stored_in_6.wait(), 10)  # arrives after the claim took effect
            return await inner.handle_async_request(request)
        if es is not None and es[1] == 1:
            epochs_of_seq1.append(es[0])
            seq1_resent.set()
        resp = await inner.handle_async_request(request)
        if es == (6, 0):
            seq0_stored_in_6.set()
            await asyncio.wait_for(seq1_resent.wait(), 10)  # its 200 comes back after seq 1's 403
        return resp

    p = AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/claim-twice",
        producer_id="twice",
        epoch=0,
        auto_claim=True,
        max_in_flight=2,
        max_batch_bytes=1,
        client=hooked(hook),
    )
    await p.start()
    try:
        p.append({"i": 0})
        p.append({"i": 1})
        try:
            await p.flush(timeout=3)
        except TimeoutError:
            pytest.fail(f"flush hung: epoch {p.epoch}, seq 1 sent in epochs {sorted(set(epochs_of_seq1))}, {p.stats}")
        assert p.epoch == 6
        assert set(epochs_of_seq1) == {6}
    finally:
        await p.close(flush=False)
    msgs = await inproc_read(onceflow, "claim-twice")
    assert msgs[0] == {"old": 5}
    assert_exactly_once_in_order(msgs[1:], 2)


@pytest.mark.anyio
async def test_close_after_a_fence_reports_every_undelivered_message(
    onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient]
) -> None:
    s = await inproc_create(onceflow, "fence-close")
    fenced = False
    arrived_after_fence = 0
    three_out = asyncio.Event()
    release = asyncio.Event()  # never set while the producer is open: those requests stay out

    async def hook(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
        nonlocal arrived_after_fence
        if fenced and producer_seq(request) is not None:
            arrived_after_fence += 1
            if arrived_after_fence == 3:
                three_out.set()
            if arrived_after_fence == 1:
                await asyncio.wait_for(three_out.wait(), 10)  # answered (403) once three are out
            else:
                await release.wait()
        return await inner.handle_async_request(request)

    failures: list[tuple[OnceflowError, int]] = []
    p = AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/fence-close",
        producer_id="z2",
        epoch=0,
        max_in_flight=3,
        max_batch_bytes=64,
        client=hooked(hook),
        on_error=lambda e, k: failures.append((e, k)),
    )
    await p.start()
    try:
        for i in range(10):
            p.append({"i": i})
        await p.flush(timeout=10)
        await s.append({"new": 1}, producer=("z2", 1, 0))
        fenced = True
        for i in range(10, 40):
            p.append({"i": i})
        with pytest.raises(ProducerFencedError):
            await p.flush(timeout=10)
        assert p.in_flight_count == 2  # held by the hook
    finally:
        await p.close()
        release.set()
    assert p.stats.acked == 10
    assert sum(k for _, k in failures) == 30, f"on_error reported {sum(k for _, k in failures)} of 30 lost messages"
    assert p.stats.failed == 30 and p.pending_count == 0


@pytest.mark.anyio
async def test_epoch_file_gives_successive_producers_new_epochs(onceflow: InProcess, tmp_path: Path) -> None:
    await inproc_create(onceflow, "epochs")
    url = f"{IN_PROCESS}/v1/stream/epochs"
    epoch_file = tmp_path / "producer.epoch"
    for run in (0, 1):
        async with AsyncIdempotentProducer(
            url, producer_id="stable", epoch_file=epoch_file, client=onceflow.client
        ) as p:
            assert p.epoch == run
            for i in range(10):
                p.append({"run": run, "i": i})
        assert p.stats.acked == 10 and p.stats.duplicates == 0 and p.stats.failed == 0
    assert epoch_file.read_text() == "1"
    expected = [{"run": r, "i": i} for r in (0, 1) for i in range(10)]
    assert await inproc_read(onceflow, "epochs") == expected

    # the control: restarting with the same fixed epoch makes the new run's seq 0 look like a retry
    await inproc_create(onceflow, "same-epoch")
    url2 = f"{IN_PROCESS}/v1/stream/same-epoch"
    for run in (0, 1):
        async with AsyncIdempotentProducer(url2, producer_id="stuck", epoch=0, client=onceflow.client) as p:
            for i in range(10):
                p.append({"run": run, "i": i})
    assert p.stats.duplicates > 0
    assert await inproc_read(onceflow, "same-epoch") == [{"run": 0, "i": i} for i in range(10)]


# ---------------------------------------------------------------------- c. closed streams


@pytest.mark.anyio
async def test_appending_to_a_closed_stream_fails_with_stream_closed_error(onceflow: InProcess) -> None:
    s = await inproc_create(onceflow, "closed")
    await s.append({"x": 1})
    closed = await s.close_stream()
    failures: list[tuple[OnceflowError, int]] = []
    p = AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/closed",
        max_in_flight=2,
        max_batch_bytes=16,
        client=onceflow.client,
        on_error=lambda e, k: failures.append((e, k)),
    )
    await p.start()
    try:
        for i in range(12):
            p.append({"i": i})
        with pytest.raises(StreamClosedError) as exc:
            await p.flush(timeout=10)
        assert exc.value.status == 409 and exc.value.next_offset == closed.next_offset
        assert failures and all(isinstance(e, StreamClosedError) for e, _ in failures)
        assert sum(k for _, k in failures) == 12 == p.stats.failed
        assert p.stats.acked == 0 and p.pending_count == 0
        with pytest.raises(StreamClosedError):
            p.append({"i": 12})
    finally:
        await p.close()
    assert await inproc_read(onceflow, "closed") == [{"x": 1}]


@pytest.mark.slow
def test_stream_closed_while_a_blocking_producer_runs(shared_server: ServerProcess) -> None:
    base = shared_server.url
    create_json_stream(base, "closed-mid")
    failures: list[tuple[OnceflowError, int]] = []
    p = IdempotentProducer(base, "closed-mid", on_error=lambda e, k: failures.append((e, k)))
    try:
        for i in range(5):
            p.append({"i": i})
        p.flush(timeout=20)
        with Stream.connect(base, "closed-mid") as s:
            s.close_stream()
        accepted = append_until_refused(p, [{"i": i} for i in range(5, 8)], StreamClosedError)
        with pytest.raises(StreamClosedError):
            p.flush(timeout=20)
        wait_until_settled(p)
        assert all(isinstance(e, StreamClosedError) for e, _ in failures)
        assert sum(k for _, k in failures) == accepted and p.stats.failed == accepted and p.stats.acked == 5
    finally:
        p.close()
    assert_exactly_once_in_order(read_all(base, "closed-mid"), 5)


# ---------------------------------------------------------------------- c. counters and batching


@pytest.mark.anyio
async def test_pending_and_in_flight_counts(onceflow: InProcess, hooked: Callable[[Hook], httpx.AsyncClient]) -> None:
    await inproc_create(onceflow, "counts")
    gate = asyncio.Event()

    async def hook(request: httpx.Request, inner: httpx.AsyncBaseTransport) -> httpx.Response:
        if request.method == "POST":
            await gate.wait()
        return await inner.handle_async_request(request)

    p = AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/counts", max_in_flight=3, max_batch_bytes=1, client=hooked(hook)
    )
    await p.start()
    try:
        for i in range(20):
            p.append({"i": i})
        assert p.pending_count == 20 and p.stats.appended == 20
        for _ in range(200):  # let the sender start what it may (no time passes: the gate holds them)
            if p.in_flight_count == 3:
                break
            await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
        assert p.in_flight_count == 3, "max_in_flight was not respected (or not reached)"
        assert p.stats.requests == 3 and p.pending_count == 20
        gate.set()
        await p.flush(timeout=20)
        await asyncio.sleep(0)  # done-callbacks of the last requests
        assert p.pending_count == 0 and p.in_flight_count == 0
        assert p.stats.acked == 20 and p.stats.batches_sent == 20
    finally:
        await p.close()
    assert_exactly_once_in_order(await inproc_read(onceflow, "counts"), 20)


@pytest.mark.anyio
async def test_in_flight_count_is_zero_right_after_async_flush(onceflow: InProcess) -> None:
    await inproc_create(onceflow, "counts-now")
    async with AsyncIdempotentProducer(f"{IN_PROCESS}/v1/stream/counts-now", client=onceflow.client) as p:
        p.append({"i": 0})
        await p.flush()  # (with a timeout, wait_for's extra hops hide it)
        assert p.pending_count == 0
        assert p.in_flight_count == 0


@pytest.mark.slow
def test_blocking_counts_after_flush(shared_server: ServerProcess) -> None:
    create_json_stream(shared_server.url, "counts-blocking")
    with IdempotentProducer(shared_server.url, "counts-blocking", max_in_flight=2, max_batch_bytes=64) as p:
        for i in range(500):
            p.append({"i": i})
        assert p.pending_count > 0
        p.flush(timeout=20)
        assert p.pending_count == 0 and p.in_flight_count == 0
        assert p.stats.acked == 500
    assert_exactly_once_in_order(read_all(shared_server.url, "counts-blocking"), 500)


@pytest.mark.anyio
async def test_linger_batches_many_appends_into_few_requests(onceflow: InProcess) -> None:
    await inproc_create(onceflow, "linger")
    n, linger = 300, 0.05
    async with AsyncIdempotentProducer(
        f"{IN_PROCESS}/v1/stream/linger", linger_ms=linger * 1000, client=onceflow.client
    ) as p:
        t0 = time.monotonic()
        for i in range(n):
            p.append({"i": i})
            await asyncio.sleep(0.001)  # the loop is idle between appends: without linger each would go alone
        await p.flush(timeout=20)
        elapsed = time.monotonic() - t0
        stats = p.stats
    # each batch but the one flush sealed waited `linger` from its first message, and the next batch
    # starts after it was sealed: at most one batch per linger period, plus the flushed one
    assert stats.batches_sent <= elapsed / linger + 2, (stats, elapsed)
    assert stats.batches_sent < n // 2
    assert stats.acked == n and stats.requests == stats.batches_sent
    assert_exactly_once_in_order(await inproc_read(onceflow, "linger"), n)


@pytest.mark.anyio
async def test_an_exactly_once_async_consumer_reads_its_group_offsets_through_its_own_client(
    onceflow: InProcess,
) -> None:
    """An exactly-once ``AsyncConsumer`` starts where its group's committed offsets say, asking
    the server through the client it was given (its transport, auth and TLS settings), on its own
    event loop: not through a blocking client of its own in a thread, which here (an in-process
    server, no socket) could never connect."""
    from onceflow.client import AsyncConsumer

    c = onceflow.client
    assert (await c.put("/v1/stream/eo/in", headers={"content-type": JSON})).status_code == 201
    offs = []
    for i in range(4):
        r = await c.post("/v1/stream/eo/in", json=[{"i": i}], headers={"content-type": JSON})
        offs.append(r.headers["stream-next-offset"])
    r = await c.post("/v1/groups/eo-g/offsets", json={"offsets": {"eo/in": offs[1]}})
    assert r.status_code == 200, r.text
    consumer = AsyncConsumer(
        "http://testserver", group="eo-g", streams=["eo/in"], delivery="exactly-once", live=None, client=c
    )
    async with consumer:
        got = await asyncio.wait_for(consumer.poll(10), timeout=10)
    assert [m.value for m in got] == [{"i": 2}, {"i": 3}]


@pytest.mark.anyio
async def test_a_commit_cut_short_keeps_its_offsets_for_the_next(onceflow: InProcess) -> None:
    """An ``AsyncConsumer`` whose offsets commit is cancelled or times out (its request was never
    answered) commits the same offsets next time, instead of forgetting them."""
    from onceflow.client import AsyncConsumer, GroupOffsetStore

    class SlowOffsets(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner
            self.slow = True

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if self.slow and request.method == "POST" and "/v1/groups/" in request.url.path:
                await asyncio.sleep(5)
            return await self.inner.handle_async_request(request)

    transport = SlowOffsets(httpx.ASGITransport(app=onceflow.app))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        r = await c.put("/v1/stream/cs", headers={"content-type": JSON}, content=b"[1, 2]")
        assert r.status_code == 201
        store = GroupOffsetStore("http://testserver")
        consumer = AsyncConsumer("http://testserver", group="cg", streams=["cs"], live=None, client=c, store=store)
        async with consumer:
            assert [m.value for m in await consumer.poll(5)] == [1, 2]
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(consumer.commit(), 0.05)
            transport.slow = False
            await consumer.commit()
        offsets = (await c.get("/v1/groups/cg/offsets")).json()["offsets"]
        assert offsets == {"cs": r.headers["stream-next-offset"]}
