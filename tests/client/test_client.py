"""The Python client against a real server: streams, errors, consumers, topics, public surface."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

import onceflow.client as client_pkg
from helpers.servers import ServerProcess
from onceflow.client import (
    AsyncStream,
    Consumer,
    FileOffsetStore,
    MemoryOffsetStore,
    PreconditionFailedError,
    Stream,
    StreamClosedError,
    StreamNotFoundError,
    TopicProducer,
    partition_for,
)
from onceflow.client._errors import (
    BadRequestError,
    ConflictError,
    ContentTypeMismatchError,
    OnceflowError,
    ProducerFencedError,
    SequenceGapError,
    ServerError,
    TransportError,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = ServerProcess(tmp_path_factory.mktemp("client") / "data")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()


def test_public_surface_is_what_the_docs_promise() -> None:
    expected = {
        "AbortRequiredError",
        "AppendResult",
        "AsyncConsumer",
        "AsyncIdempotentProducer",
        "AsyncOffsetStore",
        "AsyncStream",
        "AsyncTransactionalProducer",
        "BadRequestError",
        "Chunk",
        "CommitOutcomeUnknownError",
        "ConflictError",
        "Consumer",
        "ContentTypeMismatchError",
        "Delivery",
        "FileOffsetStore",
        "ForbiddenError",
        "GroupOffsetStore",
        "IdempotentProducer",
        "TransactionalProducer",
        "LiveMode",
        "MemoryOffsetStore",
        "Message",
        "OffsetStore",
        "OnceflowError",
        "OutcomeUnknownError",
        "PayloadTooLargeError",
        "PreconditionFailedError",
        "ProducerFencedError",
        "ProducerStats",
        "Retention",
        "OffsetGoneError",
        "SequenceGapError",
        "ServerError",
        "Stream",
        "StreamClosedError",
        "StreamGoneError",
        "StreamInfo",
        "StreamNotFoundError",
        "TopicProducer",
        "TransportError",
        "UnknownTransactionalIdError",
        "partition_for",
        "partition_names",
    }
    assert set(client_pkg.__all__) == expected
    public = {n for n in dir(client_pkg) if not n.startswith("_")}
    assert expected <= public
    for name in (
        "BadRequestError",
        "ProducerFencedError",
        "StreamClosedError",
        "TransportError",
        "ServerError",
        "OutcomeUnknownError",
        "CommitOutcomeUnknownError",
        "AbortRequiredError",
    ):
        assert issubclass(getattr(client_pkg, name), OnceflowError)


def test_stream_lifecycle_and_json_messages(base: str) -> None:
    with Stream.connect(base, "life") as s:
        info = s.create("application/json", ttl=3600)
        assert info.next_offset == "0000000000000000_0000000000000000" and info.ttl_seconds == 3600
        assert s.create("application/json", ttl=3600).next_offset == info.next_offset  # idempotent
        r = s.append({"a": 1})
        assert not r.duplicate and r.next_offset and r.next_offset > info.next_offset
        s.append_many([{"b": 2}, [3, 4]])  # a list value stays one message
        assert list(s.messages()) == [{"a": 1}, {"b": 2}, [3, 4]]
        first = s.read()
        assert first.up_to_date and first.messages() == [{"a": 1}, {"b": 2}, [3, 4]]
        assert s.read(first.next_offset).messages() == []
        closed = s.close_stream()
        assert closed.closed
        assert s.head().closed
        with pytest.raises(StreamClosedError) as exc:
            s.append({"late": True})
        assert exc.value.next_offset == closed.next_offset and exc.value.status == 409 and not exc.value.retriable
        chunks = list(s.chunks(first.next_offset, live="long-poll"))  # a closed stream ends live reads
        assert chunks[-1].closed and chunks[-1].next_offset == closed.next_offset
        assert all(not c.data for c in chunks)
        s.delete()
        assert not s.exists()
        with pytest.raises(StreamNotFoundError):
            s.read()


def test_byte_streams_and_if_match(base: str) -> None:
    with Stream.connect(base, "bytes") as s:
        s.create("application/octet-stream")
        tail = s.head().next_offset
        s.append(b"\x00\x01", if_match=tail)
        with pytest.raises(PreconditionFailedError) as exc:
            s.append(b"\x02", if_match=tail)
        assert exc.value.next_offset == s.head().next_offset
        s.append("text")
        assert s.read().data == b"\x00\x01text"
        with pytest.raises(TypeError):
            s.append({"not": "bytes"})


def test_single_idempotent_append_is_deduplicated(base: str) -> None:
    with Stream.connect(base, "idem") as s:
        s.create("application/json")
        a = s.append({"x": 1}, producer=("p", 0, 0))
        b = s.append({"x": 1}, producer=("p", 0, 0))
        assert (a.duplicate, b.duplicate) == (False, True)
        assert a.next_offset == b.next_offset
        with pytest.raises(SequenceGapError) as gap:
            s.append({"x": 3}, producer=("p", 0, 5))
        assert (gap.value.expected_seq, gap.value.received_seq) == (1, 5)
        s.append({"x": 2}, producer=("p", 1, 0))
        with pytest.raises(ProducerFencedError) as fenced:
            s.append({"x": 9}, producer=("p", 0, 1))
        assert fenced.value.current_epoch == 1
        assert list(s.messages()) == [{"x": 1}, {"x": 2}]


def test_errors_map_to_typed_exceptions(base: str) -> None:
    with Stream.connect(base, "err") as s:
        s.create("application/json")
        with pytest.raises(ConflictError):
            s.create("text/plain")
        with pytest.raises(BadRequestError) as bad:
            s.append(b"{not json")
        assert "JSON" in bad.value.message and bad.value.status == 400
        with Stream(s.url, content_type="text/plain") as wrong:
            with pytest.raises(ContentTypeMismatchError):
                wrong.append("plain text")
    with Stream("http://127.0.0.1:1/v1/stream/x", content_type="text/plain") as dead:
        with pytest.raises(TransportError) as gone:
            dead.append("x")
        assert gone.value.retriable and gone.value.status is None
    assert ServerError("x", status=503).retriable


def test_live_reads_deliver_new_data_by_long_poll_and_sse(base: str) -> None:
    for mode in ("long-poll", "sse"):
        name = f"live-{mode}"
        with Stream.connect(base, name) as s:
            s.create("application/json")
            s.append({"n": 0})
            got: list[object] = []

            def read(live_mode: str, stream_name: str, out: list[object]) -> None:
                with Stream.connect(base, stream_name) as r:
                    for m in r.messages("-1", live=live_mode):  # type: ignore[arg-type]
                        out.append(m)
                        if len(out) == 3:
                            return

            t = threading.Thread(target=read, args=(mode, name, got))
            t.start()
            time.sleep(0.2)
            s.append({"n": 1})
            s.append({"n": 2})
            t.join(15)
            assert not t.is_alive()
            assert got == [{"n": 0}, {"n": 1}, {"n": 2}]


@pytest.mark.anyio
async def test_async_stream_mirrors_the_blocking_one(base: str) -> None:
    async with AsyncStream.connect(base, "async") as s:
        await s.create("application/json")
        await s.append({"a": 1})
        await s.append_many([{"b": 2}])
        assert [m async for m in s.messages()] == [{"a": 1}, {"b": 2}]
        info = await s.head()
        assert not info.closed
        await s.close_stream()
        chunks = [c async for c in s.chunks("-1", live="sse")]
        assert chunks[-1].closed and chunks[0].messages() == [{"a": 1}, {"b": 2}]


def _fill(base: str, name: str, n: int, per_append: int = 10) -> None:
    with Stream.connect(base, name) as s:
        s.create("application/json")
        for i in range(0, n, per_append):
            s.append_many([{"s": name, "i": j} for j in range(i, min(n, i + per_append))])


def test_at_least_once_redelivers_after_a_crash_and_at_most_once_skips(base: str, tmp_path: Path) -> None:
    for delivery in ("at-least-once", "at-most-once"):
        name = f"dl/{delivery}"
        _fill(base, name, 20)
        store = FileOffsetStore(tmp_path / f"{delivery}.json")
        c = Consumer(base, group="g", streams=[name], store=store, delivery=delivery, live=None)  # type: ignore[arg-type]
        first = [m.value["i"] for m in c.poll(5)]
        assert first == list(range(20))
        c.close()  # "crash" while processing `first`: nothing else was committed
        with Stream.connect(base, name) as s:
            s.append_many([{"s": name, "i": i} for i in range(20, 25)])
        c = Consumer(base, group="g", streams=[name], store=store, delivery=delivery, live=None)  # type: ignore[arg-type]
        again = [m.value["i"] for batch in iter(partial(c.poll, 5), []) for m in batch]
        c.close()
        if delivery == "at-least-once":
            assert again == list(range(25))  # the unprocessed read comes back
        else:
            assert again == list(range(20, 25))  # it was committed before delivery: skipped


def test_consumer_reads_a_prefix_without_loss_across_restarts(base: str, tmp_path: Path) -> None:
    for p in range(3):
        _fill(base, f"pre/{p}", 40)
    _fill(base, "other", 5)
    store = FileOffsetStore(tmp_path / "offsets.json")
    c = Consumer(base, group="g1", prefix="pre/", store=store, live=None)
    first: list[tuple[str, int]] = []
    for m in c:
        first.append((m.value["s"], m.value["i"]))
        if len(first) == 46:
            break  # stop in the middle of a read
    c.commit()
    c.close()
    c = Consumer(base, group="g1", prefix="pre/", store=store, live=None)
    second = [(m.value["s"], m.value["i"]) for m in c]
    c.close()
    expected = {(f"pre/{p}", i) for p in range(3) for i in range(40)}
    assert set(first) | set(second) == expected  # nothing lost, "other" never read
    repeated = [x for x in second if x in set(first)]
    # only the partly processed read comes back: one stream, from where that read started
    assert len({s for s, _ in repeated}) <= 1
    if repeated:
        stream = repeated[0][0]
        assert [i for s, i in second if s == stream][: len(repeated)] == [i for _, i in repeated]
    for run in (first, second):  # order per stream
        for p in range(3):
            mine = [i for s, i in run if s == f"pre/{p}"]
            assert mine == sorted(mine)
    other = Consumer(base, group="g2", prefix="pre/", store=store, live=None)  # groups are independent
    assert sum(1 for _ in other) == 120
    other.close()


def test_live_prefix_consumer_discovers_new_streams(base: str) -> None:
    _fill(base, "disc/0", 3)
    c = Consumer(base, group="g", prefix="disc/", store=MemoryOffsetStore(), live="long-poll", discover_interval=0.2)
    try:
        assert len(c.poll(5)) == 3
        _fill(base, "disc/1", 2)
        got = c.poll(10)
        assert [m.stream for m in got] == ["disc/1", "disc/1"]
    finally:
        c.close()


def test_offset_stores_only_move_forward(tmp_path: Path) -> None:
    for store in (MemoryOffsetStore(), FileOffsetStore(tmp_path / "o.json")):
        store.commit("g", {"s": "0000000000000005_0000000000000100"})
        store.commit("g", {"s": "0000000000000003_0000000000000060"})
        assert store.load("g", "s") == "0000000000000005_0000000000000100"
        assert store.load("g", "missing") is None
    assert FileOffsetStore(tmp_path / "o.json").load("g", "s") == "0000000000000005_0000000000000100"


def test_an_exactly_once_consumer_leaves_commits_to_the_transaction(base: str) -> None:
    _fill(base, "eos/in", 5)
    c = Consumer(base, group="eos-g", streams=["eos/in"], delivery="exactly-once", live=None)
    try:
        assert len(c.poll(5)) == 5
        with pytest.raises(OnceflowError):
            c.commit()
    finally:
        c.close()


def test_partitioning_is_a_stable_crc32(base: str) -> None:
    # values any implementation can reproduce: zlib CRC-32 of the UTF-8 key, mod n
    assert partition_for("user-1", 8) == zlib.crc32(b"user-1") % 8
    assert [partition_for(k, 4) for k in ("a", "b", "c")] == [zlib.crc32(k.encode()) % 4 for k in "abc"]
    with TopicProducer(base, "t", partitions=3) as tp:
        for i in range(300):
            tp.send(f"k{i % 10}", {"k": f"k{i % 10}", "i": i})
    for p in range(3):
        with Stream.connect(base, f"t/{p}") as s:
            msgs = list(s.messages())
        assert all(partition_for(m["k"], 3) == p for m in msgs)
        by_key: dict[str, list[int]] = {}
        for m in msgs:
            by_key.setdefault(m["k"], []).append(m["i"])
        assert all(v == sorted(v) for v in by_key.values())  # order per key
    with pytest.raises(ConflictError):
        TopicProducer(base, "t", partitions=3, content_type="text/plain")


def test_producer_id_comes_from_the_environment(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from onceflow.client import IdempotentProducer

    with Stream.connect(base, "envp") as s:
        s.create("application/json")
    monkeypatch.setenv("ONCEFLOW_PRODUCER_ID", "from-env")
    with IdempotentProducer(base, "envp") as p:
        p.append({"x": 1})
        assert p.producer_id == "from-env" and p.epoch > 0  # a named producer gets a fresh epoch
    monkeypatch.delenv("ONCEFLOW_PRODUCER_ID")
    with IdempotentProducer(base, "envp") as p:
        assert p.producer_id.startswith("py-") and p.epoch == 0
