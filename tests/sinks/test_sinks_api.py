"""The sink API and SinkRunner's checkpoint cycle, with in-memory sinks against a real
`onceflow serve`: the order of the steps, what a restore does in each window, misuse errors, and
the public surface. (Real PostgreSQL / Redis / webhooks: tests/sinks/test_sinks_faults.py.)"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

import onceflow.sinks
import onceflow.spark.foreach_batch
from onceflow.client import IdempotentProducer, Message, Stream
from onceflow.sinks import (
    Checkpoint,
    CheckpointAwareSink,
    FileCheckpointStore,
    IdempotentSink,
    MemoryCheckpointStore,
    SinkError,
    SinkRunner,
    Step,
    TwoPhaseCommitSink,
    key_function,
)

N, PER_APPEND, PER_CHECKPOINT = 30, 5, 10


def fill(url: str, name: str) -> str:
    """``N`` messages {"id": i} in appends of PER_APPEND; returns the tail offset."""
    with Stream.connect(url, name) as s:
        s.create("application/json")
    with IdempotentProducer(url, name, content_type="application/json", max_in_flight=1) as p:
        for start in range(0, N, PER_APPEND):
            p.extend([{"id": i} for i in range(start, start + PER_APPEND)])
            p.flush()
    with Stream.connect(url, name) as s:
        return s.head().next_offset


def group_offsets(url: str, group: str) -> dict[str, str]:
    offsets: dict[str, str] = httpx.get(f"{url}/v1/groups/{group}/offsets").json()["offsets"]
    return offsets


class External:
    """A fake transactional system whose prepared and committed transactions outlive a sink."""

    def __init__(self) -> None:
        self.prepared: dict[str, list[int]] = {}
        self.committed: list[int] = []
        self.log: list[str] = []


class MemoryTwoPhaseSink(TwoPhaseCommitSink[dict[str, Any]]):
    def __init__(self, ext: External) -> None:
        super().__init__()
        self.ext = ext

    def begin_transaction(self, checkpoint_id: int) -> dict[str, Any]:
        self.ext.log.append(f"begin t{checkpoint_id}")
        return {"id": f"t{checkpoint_id}", "rows": []}

    def invoke(self, txn: dict[str, Any], messages: Sequence[Message]) -> None:
        txn["rows"].extend(m.value["id"] for m in messages)

    def pre_commit(self, txn: dict[str, Any]) -> None:
        self.ext.log.append(f"pre_commit {txn['id']}")
        self.ext.prepared[txn["id"]] = txn["rows"]

    def commit(self, txn: dict[str, Any]) -> None:
        self.ext.log.append(f"commit {txn['id']}")
        self.ext.committed.extend(self.ext.prepared.pop(txn["id"]))

    def abort(self, txn: dict[str, Any]) -> None:
        self.ext.log.append(f"abort {txn['id']}")
        self.ext.prepared.pop(txn["id"], None)

    def handle(self, txn: dict[str, Any]) -> str:
        return str(txn["id"])

    def recover_and_commit(self, handle: Any) -> None:
        self.ext.log.append(f"recover_and_commit {handle}")
        if handle in self.ext.prepared:
            self.ext.committed.extend(self.ext.prepared.pop(handle))

    def recover_and_abort(self, handle: Any) -> None:
        self.ext.log.append(f"recover_and_abort {handle}")
        self.ext.prepared.pop(handle, None)

    def prepared_handles(self) -> list[Any]:
        return list(self.ext.prepared)


class Crash(Exception):
    """Raised from on_step: the process "dies" at that point (nothing after it runs)."""


def crash_at(step: Step, checkpoint: int, log: list[str] | None = None) -> Any:
    def on_step(s: Step, cp: int) -> None:
        if log is not None:
            log.append(f"{s} {cp}")
        if (s, cp) == (step, checkpoint):
            raise Crash(f"{s} {cp}")

    return on_step


def runner(url: str, sink: CheckpointAwareSink, job: str, stream: str, **kw: Any) -> SinkRunner:
    return SinkRunner(url, sink, job=job, streams=[stream], checkpoint_messages=PER_CHECKPOINT, max_read_bytes=64, **kw)


def test_two_phase_commit_steps_run_in_order_and_ack_last(onceflow_url: str) -> None:
    job = f"order-{uuid.uuid4().hex[:6]}"
    stream = f"in-{job}"
    tail = fill(onceflow_url, stream)
    ext = External()
    store = MemoryCheckpointStore()
    saved: list[dict[str, str]] = []
    acked_when_committed: list[dict[str, str]] = []

    def on_step(step: Step, cp: int) -> None:
        ext.log.append(f"{step} {cp}")
        if step == "saved":
            checkpoint = store.load(job)
            assert checkpoint is not None and (checkpoint.id, checkpoint.handle) == (cp, f"t{cp}")
            saved.append(checkpoint.offsets)
        if step == "committed":
            acked_when_committed.append(group_offsets(onceflow_url, job))

    stats = runner(onceflow_url, MemoryTwoPhaseSink(ext), job, stream, checkpoints=store, on_step=on_step).run()
    assert ext.committed == list(range(N))
    assert (stats.checkpoints, stats.messages) == (3, N)
    assert ext.log[:10] == [
        "restored 0",
        "begin t1",
        "started 1",
        "pre_commit t1",
        "prepared 1",
        "saved 1",
        "commit t1",
        "committed 1",
        "marked 1",
        "acked 1",
    ]
    # when the sink commits checkpoint N, the group is still acknowledged at checkpoint N-1: never ahead
    assert acked_when_committed == [{}, *saved[:-1]]
    assert saved[-1] == {stream: tail} == group_offsets(onceflow_url, job)
    last = store.load(job)
    assert last is not None and (last.id, last.sink_committed, last.start_offsets) == (3, True, saved[1])


def test_restore_commits_a_saved_checkpoint(onceflow_url: str) -> None:
    job = f"saved-{uuid.uuid4().hex[:6]}"
    stream = f"in-{job}"
    fill(onceflow_url, stream)
    ext, store = External(), MemoryCheckpointStore()
    with pytest.raises(Crash):
        runner(
            onceflow_url, MemoryTwoPhaseSink(ext), job, stream, checkpoints=store, on_step=crash_at("saved", 2)
        ).run()
    assert ext.committed == list(range(10)) and list(ext.prepared) == ["t2"]
    ext.log.clear()
    stats = runner(onceflow_url, MemoryTwoPhaseSink(ext), job, stream, checkpoints=store).run()
    assert ext.log[0] == "recover_and_commit t2"
    assert (stats.restored, stats.replayed, stats.messages) == (2, False, 10)
    assert ext.committed == list(range(N)) and ext.prepared == {}


def test_restore_aborts_a_prepared_transaction_no_checkpoint_names(onceflow_url: str) -> None:
    job = f"stray-{uuid.uuid4().hex[:6]}"
    stream = f"in-{job}"
    fill(onceflow_url, stream)
    ext, store = External(), MemoryCheckpointStore()
    with pytest.raises(Crash):
        runner(
            onceflow_url, MemoryTwoPhaseSink(ext), job, stream, checkpoints=store, on_step=crash_at("prepared", 2)
        ).run()
    assert list(ext.prepared) == ["t2"]
    ext.log.clear()
    stats = runner(onceflow_url, MemoryTwoPhaseSink(ext), job, stream, checkpoints=store).run()
    assert ext.log[0] == "recover_and_abort t2"
    assert (stats.restored, stats.replayed, stats.messages) == (1, False, 20)
    assert ext.committed == list(range(N)) and ext.prepared == {}


class EmitOnComplete(CheckpointAwareSink):
    """Commit-on-checkpoint: buffers, emits into ``out`` when the checkpoint completes."""

    def __init__(self, out: list[int]) -> None:
        self.out = out
        self.buffer: list[int] = []

    def write(self, messages: Sequence[Message]) -> None:
        self.buffer.extend(m.value["id"] for m in messages)

    def on_checkpoint_complete(self, checkpoint: Checkpoint) -> None:
        self.out.extend(self.buffer)
        self.buffer = []

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        self.buffer = []


def test_a_saved_but_uncompleted_checkpoint_is_replayed_from_its_start(onceflow_url: str, tmp_path: Path) -> None:
    """The seed's rule: recovery skips a checkpoint the sink did not commit, and reads its input again."""
    job = f"replay-{uuid.uuid4().hex[:6]}"
    stream = f"in-{job}"
    tail = fill(onceflow_url, stream)
    out: list[int] = []
    store = FileCheckpointStore(tmp_path / "cp.json")
    with pytest.raises(Crash):
        runner(onceflow_url, EmitOnComplete(out), job, stream, checkpoints=store, on_step=crash_at("saved", 2)).run()
    saved = store.load(job)
    assert saved is not None and (saved.id, saved.sink_committed) == (2, False)
    stats = runner(onceflow_url, EmitOnComplete(out), job, stream, checkpoints=store).run()
    assert (stats.restored, stats.replayed, stats.messages) == (2, True, 20)
    assert out == list(range(N))
    assert group_offsets(onceflow_url, job) == {stream: tail}


class Collect(IdempotentSink):
    def __init__(self, out: dict[str, int]) -> None:
        super().__init__("id")
        self.out = out

    def write_idempotent(self, records: Sequence[tuple[str, Message]]) -> None:
        for key, msg in records:
            self.out.setdefault(key, msg.value["id"])


def test_live_runner_follows_input_that_arrives_later(onceflow_url: str) -> None:
    job = f"live-{uuid.uuid4().hex[:6]}"
    stream = f"in-{job}"
    fill(onceflow_url, stream)
    out: dict[str, int] = {}
    result: list[Any] = []
    r = SinkRunner(
        onceflow_url, Collect(out), job=job, streams=[stream], live=True, checkpoint_messages=N, checkpoint_interval=0.2
    )
    thread = threading.Thread(target=lambda: result.append(r.run(max_checkpoints=2)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while len(out) < N and time.monotonic() < deadline:
        time.sleep(0.05)
    with IdempotentProducer(onceflow_url, stream, content_type="application/json") as p:
        p.extend([{"id": i} for i in range(N, N + 5)])
        p.flush()
    thread.join(30)
    assert not thread.is_alive()
    assert sorted(out.values()) == list(range(N + 5))
    assert result[0].checkpoints == 2


def test_a_group_acknowledged_ahead_of_the_job_is_refused(onceflow_url: str) -> None:
    job = f"shared-{uuid.uuid4().hex[:6]}"
    stream = f"in-{job}"
    tail = fill(onceflow_url, stream)
    httpx.post(f"{onceflow_url}/v1/groups/{job}/offsets", json={"offsets": {stream: tail}}).raise_for_status()
    with pytest.raises(SinkError, match="must belong to this job alone"):
        runner(onceflow_url, MemoryTwoPhaseSink(External()), job, stream, checkpoints=MemoryCheckpointStore()).run()


# ---------------------------------------------------------------------------------------------- misuse


class Plain(CheckpointAwareSink):
    def write(self, messages: Sequence[Message]) -> None:
        pass


class Atomic(Plain):
    atomic = True


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: SinkRunner("http://x", MemoryTwoPhaseSink(External()), job="j", streams=["s"]),
            ValueError,
            "checkpoints=",
        ),
        (
            lambda: SinkRunner("http://x", Atomic(), job="j", streams=["s"], checkpoints=MemoryCheckpointStore()),
            ValueError,
            "stores its checkpoints",
        ),
        (lambda: SinkRunner("http://x", Plain(), job="j", streams=["s"], ack=None), ValueError, "nowhere to keep"),
        (lambda: SinkRunner("http://x", Plain(), job="j", streams=["s"], prefix="p"), ValueError, "either streams"),
        (lambda: SinkRunner("http://x", Plain(), job="", streams=["s"]), ValueError, "job"),
        (
            lambda: SinkRunner("http://x", Plain(), job="j", streams=["s"], checkpoint_messages=0),
            ValueError,
            "checkpoint_messages",
        ),
        (lambda: SinkRunner("http://x", object(), job="j", streams=["s"]), TypeError, "CheckpointAwareSink"),  # type: ignore[arg-type]
    ],
    ids=[
        "2pc-without-store",
        "atomic-with-store",
        "no-offsets",
        "streams-and-prefix",
        "no-job",
        "empty-checkpoints",
        "not-a-sink",
    ],
)
def test_runner_misuse_is_refused_clearly(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_two_phase_hooks_outside_a_checkpoint_are_refused() -> None:
    sink = MemoryTwoPhaseSink(External())
    with pytest.raises(SinkError, match="outside a checkpoint"):
        sink.write([Message("s", {"id": 1}, "-1", "x", 0)])
    with pytest.raises(SinkError, match="is not atomic"):
        Plain().load_checkpoint()


def test_key_function() -> None:
    msg = Message("s", {"id": 7, "v": "x"}, "o", "n", 3)
    assert key_function("id")(msg) == "7"
    assert key_function(lambda m: m.value["v"])(msg) == "x"
    with pytest.raises(SinkError, match=r"s@o#3 has no field 'order'"):
        key_function("order")(msg)
    with pytest.raises(SinkError, match="no field"):
        key_function("id")(Message("s", [1, 2], "o", "n", 0))
    with pytest.raises(TypeError, match="key must be"):
        key_function("")


def test_file_checkpoint_store_keeps_jobs_apart_and_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    a = Checkpoint(3, {"s": "0000000000000010_0000000000000100"}, {"s": "-1"}, {"gid": "g"}, False)
    FileCheckpointStore(path).save("a", a)
    FileCheckpointStore(path).save("b", Checkpoint(1, {}, {}))
    FileCheckpointStore(path).save("a", a.committed())
    store = FileCheckpointStore(path)
    assert store.load("a") == a.committed()
    assert store.load("b") == Checkpoint(1, {}, {})
    assert store.load("c") is None
    assert sorted(json.loads(path.read_text())) == ["a", "b"]
    assert not path.with_name("cp.json.tmp").exists()
    path.write_text("[]")
    with pytest.raises(SinkError, match="not a checkpoint file"):
        store.load("a")


def test_concrete_sinks_refuse_bad_arguments() -> None:
    from onceflow.sinks import PostgresTransactionalSink, PostgresUpsertSink, RedisAtomicSink, RedisIdempotentSink

    with pytest.raises(ValueError, match="key_columns"):
        PostgresUpsertSink("host=127.0.0.1", "t", ["id", "v"], key_columns=["nope"])
    with pytest.raises(ValueError, match="schema.name"):
        PostgresTransactionalSink("host=127.0.0.1", "a.b.c", ["id"], job="j")
    with pytest.raises(ValueError, match="columns"):
        PostgresTransactionalSink("host=127.0.0.1", "t", [], job="j")
    with pytest.raises(ValueError, match="hash slots"):
        RedisAtomicSink("redis://127.0.0.1:1/0", job="j", key="elsewhere")
    assert RedisAtomicSink("redis://127.0.0.1:1/0", job="j", key="mine:{j}").key == "mine:{j}"
    with pytest.raises(ValueError, match="commit_retries"):
        RedisAtomicSink("redis://127.0.0.1:1/0", job="j", commit_retries=-1)
    with pytest.raises(ValueError, match="ttl"):
        RedisIdempotentSink("redis://127.0.0.1:1/0", prefix="p:", key="id", ttl=0)
    with pytest.raises(TypeError, match="redis"):
        RedisIdempotentSink(42, prefix="p:", key="id")  # type: ignore[arg-type]


def test_rows_that_do_not_fit_the_columns_are_reported(pg: str) -> None:
    from onceflow.sinks import PostgresInsertSink

    sink = PostgresInsertSink(pg, "t", ["id", "v"])
    with pytest.raises(SinkError, match=r"no field\(s\) \['v'\]"):
        sink.rows([Message("s", {"id": 1}, "o", "n", 0)])
    with pytest.raises(SinkError, match="not a JSON object"):
        sink.rows([Message("s", "text", "o", "n", 0)])


# ---------------------------------------------------------------------------------------------- Redis script


def test_redis_commit_resent_after_a_lost_answer_changes_nothing(redis_url: str) -> None:
    import redis

    from onceflow.sinks import RedisAtomicSink, SinkFencedError

    sink = RedisAtomicSink(redis_url, job="resend")
    sink.on_checkpoint_restore(sink.load_checkpoint())
    args = [1, 0, "token-1", json.dumps({"s": "b"}), json.dumps({}), "list", "x", "y"]
    keys = [sink.key, sink.checkpoint_key]
    script = sink.redis.register_script(onceflow.sinks.redis.ATOMIC_LUA)
    assert script(keys=keys, args=args) == 1
    assert script(keys=keys, args=args) == 0  # the same commit again (the sink resends after a dropped connection)
    with redis.Redis.from_url(redis_url) as r:
        assert r.lrange(sink.key, 0, -1) == [b"x", b"y"]
    with pytest.raises(redis.ResponseError, match="FENCED"):  # a different commit of the same checkpoint
        script(keys=keys, args=[1, 0, "token-2", "{}", "{}", "list", "z"])
    sink.write([Message("s", {"id": 1}, "-1", "x", 0)])
    with pytest.raises(SinkFencedError):  # this sink restored checkpoint 0, but 1 is there now
        sink.on_checkpoint_complete(Checkpoint(1, {"s": "c"}, {}, None, True))
    cp = sink.load_checkpoint()
    assert cp is not None and (cp.id, cp.offsets) == (1, {"s": "b"})


def test_redis_wrong_type_fails_before_writing_anything(redis_url: str) -> None:
    import redis

    from onceflow.sinks import RedisAtomicSink

    with redis.Redis.from_url(redis_url) as r:
        r.set("onceflow:{wrongtype}:out", "a string")
    sink = RedisAtomicSink(redis_url, job="wrongtype")
    sink.on_checkpoint_restore(sink.load_checkpoint())
    sink.write([Message("s", {"id": 1}, "-1", "x", 0)])
    with pytest.raises(SinkError, match="WRONGTYPE"):
        sink.on_checkpoint_complete(Checkpoint(1, {"s": "b"}, {}, None, True))
    assert sink.load_checkpoint() is None


# ---------------------------------------------------------------------------------------------- surface


def test_public_surface() -> None:
    assert sorted(onceflow.sinks.__all__) == [
        "Checkpoint",
        "CheckpointAwareSink",
        "CheckpointStore",
        "FileCheckpointStore",
        "IdempotentSink",
        "KeyFunction",
        "MemoryCheckpointStore",
        "OutboxSink",
        "PostgresInsertSink",
        "PostgresTransactionalSink",
        "PostgresTwoPhaseSink",
        "PostgresUpsertSink",
        "RedisAtomicSink",
        "RedisIdempotentSink",
        "RedisListSink",
        "RunStats",
        "SinkError",
        "SinkFencedError",
        "SinkRunner",
        "Step",
        "TwoPhaseCommitSink",
        "Webhook",
        "WebhookRejectedError",
        "WebhookSink",
        "key_function",
        "outbox_dispatcher",
    ]
    for name in onceflow.sinks.__all__:
        assert getattr(onceflow.sinks, name) is not None
    with pytest.raises(AttributeError):
        _ = onceflow.sinks.NoSuchSink
    assert onceflow.spark.foreach_batch.__all__ == [
        "PostgresBatchSink",
        "RedisBatchSink",
        "postgres_sink",
        "redis_sink",
    ]
