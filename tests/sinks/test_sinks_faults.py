"""Every exactly-once sink in every fault window, against a real `onceflow serve`, a real
PostgreSQL and a real Redis (throwaway instances, see tests/sinks/conftest.py).

The windows (docs/sinks.md has the table):

- kill -9 after *prepare*, before the checkpoint is saved (2PC: between pre-commit and the commit
  decision): recovery rolls back / replays;
- kill -9 with the checkpoint saved but the sink not committed (kinds with a checkpoint store; 2PC:
  between pre-commit and commit, recovery must finish the commit);
- kill -9 with the sink committed but the acknowledgement (group offsets) not written;
- the commit fails; the commit succeeds but reports an error.

Invariant, always: the target holds exactly the expected rows (a list comparison, so a duplicate
shows), and the acknowledged offsets are the end of the input.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.sinkkit import (
    CHECKPOINT_MESSAGES,
    COMMIT_HOOK,
    KINDS,
    WITH_STORE,
    CommitFault,
    Env,
    FaultySink,
    HookReceiver,
    RedisAnswerDropper,
    expected,
    group_offsets,
    hook_entry,
    input_stream,
    make_sink,
    populate,
    prepare_target,
    read_stream,
    read_target,
    table,
)
from onceflow.sinks import (
    Checkpoint,
    FileCheckpointStore,
    OutboxSink,
    RunStats,
    SinkFencedError,
    SinkRunner,
    Step,
    Webhook,
    WebhookRejectedError,
    WebhookSink,
    outbox_dispatcher,
)

WORKER = Path(__file__).parent / "sink_worker.py"
IDEMPOTENT = {"pg-upsert", "redis-setnx", "webhook"}  # effects are written at prepare
FAULT_AT = 3  # the checkpoint that meets the fault; checkpoints 1 and 2 are committed before it


@pytest.fixture
def receiver() -> Iterator[HookReceiver]:
    r = HookReceiver().start()
    try:
        yield r
    finally:
        r.stop()


def make_env(
    kind: str, request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> Env:
    return Env(
        onceflow=onceflow_url,
        work=str(tmp_path),
        pg=request.getfixturevalue("pg") if kind.startswith("pg-") else None,
        redis=request.getfixturevalue("redis_url") if kind.startswith("redis-") else None,
        hooks=receiver.url,
    )


def new_job(kind: str, case: str) -> str:
    return f"{kind}-{case}-{uuid.uuid4().hex[:6]}"


def run_to_end(kind: str, env: Env, job: str, **extra: Any) -> RunStats:
    """A restarted process: a new sink and runner, run until the input is exhausted."""
    sink, kw = make_sink(kind, env, job)
    with SinkRunner(env.onceflow, sink, job=job, **{**kw, **extra}) as runner:
        return runner.run()


def check_exact(kind: str, env: Env, job: str, tail: str, receiver: HookReceiver) -> None:
    assert read_target(kind, env, job, receiver) == expected()
    # the acknowledgement (outbox: the offsets committed in its transaction) reached the end of the input
    assert group_offsets(env.onceflow, job) == {input_stream(job): tail}
    if kind == "pg-2pc":
        import psycopg

        assert env.pg is not None
        with psycopg.connect(env.pg) as conn:
            assert conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall() == []


def visible_before_recovery(kind: str, step: str) -> int:
    """How much of the output a kill at ``step`` of checkpoint FAULT_AT leaves visible."""
    if step == "committed" or kind in IDEMPOTENT:
        return FAULT_AT * CHECKPOINT_MESSAGES
    return (FAULT_AT - 1) * CHECKPOINT_MESSAGES


def kill_steps(kind: str) -> list[str]:
    return ["prepared", "saved", "committed"] if kind in WITH_STORE else ["prepared", "committed"]


KILL_CASES = [pytest.param(kind, step, id=f"{kind}-kill9-at-{step}") for kind in KINDS for step in kill_steps(kind)]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "step"), KILL_CASES)
def test_kill9_in_a_window_then_recovery_is_exact(
    kind: str, step: str, request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, step)
    tail = populate(kind, env, job)
    prepare_target(kind, env, job)
    config = {"kind": kind, "job": job, "env": env.to_json(), "kill_step": step, "kill_at": FAULT_AT}
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(config)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"the worker did not die at {step} of checkpoint {FAULT_AT}:\n{proc.stderr}"
    )

    # the window is real: the output is exactly as far as the killed process got
    assert len(read_target(kind, env, job, receiver)) == visible_before_recovery(kind, step)
    if kind == "pg-2pc":
        import psycopg

        assert env.pg is not None
        with psycopg.connect(env.pg) as conn:
            prepared = [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]
        assert prepared == ([f"onceflow:{job}:{FAULT_AT}"] if step in ("prepared", "saved") else [])

    stats = run_to_end(kind, env, job)
    check_exact(kind, env, job, tail, receiver)
    if kind in WITH_STORE or kind in ("pg-transactional", "redis-atomic"):
        # where the checkpoint ids are kept, the restore shows which way the window was closed: a
        # saved checkpoint not yet marked committed is finished by 2PC and replayed by idempotent sinks
        restored = FAULT_AT if step != "prepared" else FAULT_AT - 1
        replayed = kind in IDEMPOTENT and step in ("saved", "committed")
        assert (stats.restored, stats.replayed) == (restored, replayed)
    if kind == "webhook":
        assert receiver.repeats == CHECKPOINT_MESSAGES  # checkpoint 3 was delivered again; the keys absorbed it
        assert receiver.without_key == 0


COMMIT_CASES = [
    pytest.param(kind, after, id=f"{kind}-{'commit-succeeds-but-errors' if after else 'commit-fails'}")
    for kind in KINDS
    if kind != "webhook"
    for after in (False, True)
]


@pytest.mark.parametrize(("kind", "after"), COMMIT_CASES)
def test_commit_fault_then_restart_is_exact(
    kind: str, after: bool, request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "commit")
    tail = populate(kind, env, job)
    prepare_target(kind, env, job)
    sink, kw = make_sink(kind, env, job)
    faulty = FaultySink(sink, COMMIT_HOOK[kind], FAULT_AT, after=after)
    with SinkRunner(env.onceflow, faulty, job=job, **kw) as runner, pytest.raises(CommitFault):
        runner.run()
    assert faulty.fired
    assert len(read_target(kind, env, job, receiver)) == (FAULT_AT if after else FAULT_AT - 1) * CHECKPOINT_MESSAGES
    run_to_end(kind, env, job)
    check_exact(kind, env, job, tail, receiver)


def test_a_failed_run_can_simply_be_run_again(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """The same runner and sink objects, in the same process: run() restores before it continues."""
    kind = "pg-2pc"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "again")
    tail = populate(kind, env, job)
    prepare_target(kind, env, job)
    sink, kw = make_sink(kind, env, job)
    faulty = FaultySink(sink, "on_checkpoint_complete", FAULT_AT, after=False)
    with SinkRunner(env.onceflow, faulty, job=job, **kw) as runner:
        with pytest.raises(CommitFault):
            runner.run()
        stats = runner.run()
    assert (stats.restored, stats.replayed) == (FAULT_AT, False)  # recover_and_commit finished checkpoint 3
    check_exact(kind, env, job, tail, receiver)


@pytest.mark.parametrize(
    ("kind", "step"), [("pg-transactional", "prepared"), ("pg-2pc", "saved"), ("pg-upsert", "started")]
)
def test_postgres_connection_killed_before_the_commit(
    kind: str, step: Step, request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """A real commit failure: the server terminates the sink's session just before the commit."""
    import psycopg

    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "terminated")
    tail = populate(kind, env, job)
    prepare_target(kind, env, job)
    assert env.pg is not None
    pg_conninfo = env.pg

    def terminate(s: Step, checkpoint_id: int) -> None:
        if s == step and checkpoint_id == FAULT_AT:
            with psycopg.connect(pg_conninfo, autocommit=True) as admin:
                killed = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchone()
            assert killed is not None and killed[0] >= 1

    sink, kw = make_sink(kind, env, job)
    with (
        SinkRunner(env.onceflow, sink, job=job, on_step=terminate, **kw) as runner,
        pytest.raises(psycopg.OperationalError),
    ):
        runner.run()
    run_to_end(kind, env, job)
    check_exact(kind, env, job, tail, receiver)


# ---------------------------------------------------------------------------------------------- webhooks


@pytest.mark.parametrize("fault", ["receiver-fails-before-applying", "receiver-applies-then-answers-500"])
def test_webhook_delivery_faults_are_retried_with_the_same_key(
    fault: str, request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    kind = "webhook"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "delivery")
    tail = populate(kind, env, job)
    keys = {hook_entry(job, i, receiver.url)["id"] for i in range(20, 30)}  # checkpoint 3
    if fault == "receiver-fails-before-applying":
        receiver.fail_before = set(keys)
    else:
        receiver.fail_after = set(keys)
    run_to_end(kind, env, job)
    check_exact(kind, env, job, tail, receiver)
    # each faulty entry was sent twice; after an applied one, the repeat was answered from the stored answer
    assert receiver.requests == len(expected()) + len(keys)
    assert receiver.repeats == (len(keys) if fault == "receiver-applies-then-answers-500" else 0)


def test_webhook_rejected_for_good_stops_before_the_ack(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    kind = "webhook"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "rejected")
    tail = populate(kind, env, job)
    bad = hook_entry(job, 25, receiver.url)["id"]
    real = receiver.handle
    receiver.handle = lambda key, body: 422 if key == bad else real(key, body)  # type: ignore[method-assign]
    sink, kw = make_sink(kind, env, job)
    with SinkRunner(env.onceflow, sink, job=job, **kw) as runner, pytest.raises(WebhookRejectedError) as err:
        runner.run()
    assert (err.value.status, err.value.entry_id) == (422, bad)
    acked = group_offsets(env.onceflow, job)[input_stream(job)]
    assert acked < tail  # checkpoint 3 was not acknowledged
    receiver.handle = real  # type: ignore[method-assign]
    run_to_end(kind, env, job)
    check_exact(kind, env, job, tail, receiver)


def test_outbox_to_webhooks_end_to_end(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """Source -> OutboxSink (one onceflow transaction per checkpoint) -> dispatcher -> receiver,
    with a failed commit in the outbox stage and a receiver that loses some of its answers."""
    kind = "outbox"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "e2e")
    populate(kind, env, job)
    sink, kw = make_sink(kind, env, job)
    with (
        SinkRunner(env.onceflow, FaultySink(sink, "on_checkpoint_complete", FAULT_AT, after=False), job=job, **kw) as r,
        pytest.raises(CommitFault),
    ):
        r.run()
    run_to_end(kind, env, job)
    outbox = read_stream(env.onceflow, f"outbox-{job}")
    assert len(outbox) == len(expected())
    receiver.fail_after = {e["id"] for e in outbox[::7]}
    dispatcher = outbox_dispatcher(
        env.onceflow, f"outbox-{job}", group=f"dispatch-{job}", live=False, sink=WebhookSink(retry_backoff=(0.01, 0.1))
    )
    with dispatcher:
        dispatcher.run()
    assert [f"{b['id']}:{b['v']}" for b in receiver.applied] == expected()
    assert receiver.repeats == len(outbox[::7])


# ---------------------------------------------------------------------------------------------- Redis: a lost answer


def test_redis_atomic_commit_whose_connection_drops_is_resent_and_applied_once(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """The sink's client (built from the documented ``redis://`` URL) talks through a proxy that
    lets the commit script of checkpoint 1 run in Redis and then drops the connection instead of
    relaying the answer. The sink sends the same commit again over a new connection; the script
    recognises its token, and the run goes on: the output is exact, in one run."""
    from onceflow.sinks import RedisAtomicSink

    kind = "redis-atomic"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "dropped")
    tail = populate(kind, env, job)
    proxy = RedisAnswerDropper(request.getfixturevalue("redis_server").port).start()
    try:
        proxy.drops = 1
        _, kw = make_sink(kind, env, job)
        sink = RedisAtomicSink(proxy.url, job=job)
        with SinkRunner(env.onceflow, sink, job=job, **kw) as runner:
            stats = runner.run()
        assert proxy.dropped == 1
        assert proxy.script_calls >= stats.checkpoints + 1  # the dropped commit was sent again
    finally:
        proxy.stop()
    assert stats.checkpoints == len(expected()) // CHECKPOINT_MESSAGES
    check_exact(kind, env, job, tail, receiver)


def test_redis_atomic_commit_without_an_answer_after_its_resends_raises_and_a_rerun_restores(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """Every try of checkpoint 1's commit runs in Redis and loses its answer: the run raises the
    connection error (nothing acknowledged), and a rerun restores checkpoint 1 from Redis."""
    import redis

    from onceflow.sinks import RedisAtomicSink

    kind = "redis-atomic"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "dropped-twice")
    tail = populate(kind, env, job)
    proxy = RedisAnswerDropper(request.getfixturevalue("redis_server").port).start()
    try:
        proxy.drops = 2
        _, kw = make_sink(kind, env, job)
        sink = RedisAtomicSink(proxy.url, job=job, commit_retries=1)
        with SinkRunner(env.onceflow, sink, job=job, **kw) as runner, pytest.raises(redis.ConnectionError):
            runner.run()
        assert proxy.dropped == 2
    finally:
        proxy.stop()
    assert group_offsets(env.onceflow, job) == {}  # nothing acknowledged
    assert len(read_target(kind, env, job)) == CHECKPOINT_MESSAGES  # checkpoint 1 is in Redis, once
    stats = run_to_end(kind, env, job)
    assert (stats.restored, stats.replayed) == (1, False)
    check_exact(kind, env, job, tail, receiver)


# ---------------------------------------------------------------------------------------------- fencing


@pytest.mark.parametrize("kind", ["pg-transactional", "pg-2pc", "redis-atomic"])
def test_a_zombie_runner_cannot_commit_over_a_newer_one(
    kind: str, request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """Runner A restores, stalls mid-checkpoint; runner B (same job) restores and commits; A's
    commit is refused and writes nothing. (pg-2pc: A's checkpoint 1 was prepared; B's restore
    rolled it back, and A learns so at its commit.)"""
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "zombie")
    tail = populate(kind, env, job)
    prepare_target(kind, env, job)
    zombie, _ = make_sink(kind, env, job)
    zombie.on_checkpoint_restore(zombie.load_checkpoint() if zombie.atomic else None)  # pg-2pc: an empty store
    zombie.on_checkpoint_start(1)
    from onceflow.client import Message

    zombie.write([Message(input_stream(job), {"id": 999, "v": "zombie"}, "-1", "x", 0)])
    zombie.on_checkpoint_prepare(1)
    run_to_end(kind, env, job)
    with pytest.raises(SinkFencedError):
        zombie.on_checkpoint_complete(Checkpoint(1, {input_stream(job): "x"}, {}, None, True))
    zombie.on_checkpoint_abort(1)
    zombie.close()
    check_exact(kind, env, job, tail, receiver)


def test_two_runners_of_one_two_phase_job_never_both_commit_a_checkpoint(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """Runners A and B of one PostgresTwoPhaseSink job both restore the same (empty) checkpoint and
    write checkpoint 1 from the same input. The worst moment: A prepares and commits 1, then B
    prepares 1 (the global id is free again, the marker row already there). Only one of them may
    commit: A, claimed over by B's restore, is fenced at its prepare and commits nothing."""
    from onceflow.client import Message

    kind = "pg-2pc"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "two-runners")
    prepare_target(kind, env, job)
    a, _ = make_sink(kind, env, job)
    b, _ = make_sink(kind, env, job)
    msgs = [Message(input_stream(job), {"id": i, "v": f"value-{i}"}, "-1", "x", i) for i in range(CHECKPOINT_MESSAGES)]
    a.on_checkpoint_restore(None)
    b.on_checkpoint_restore(None)  # a second runner of the job, from the same checkpoint
    for sink in (a, b):
        sink.on_checkpoint_start(1)
        sink.write(msgs)
    committed = []
    for name, sink in (("A", a), ("B", b)):
        try:
            handle = sink.on_checkpoint_prepare(1)
            sink.on_checkpoint_complete(Checkpoint(1, {input_stream(job): "x"}, {}, handle))
            committed.append(name)
        except SinkFencedError:
            sink.on_checkpoint_abort(1)
    a.close()
    b.close()
    assert read_target(kind, env, job) == [f"{i}:value-{i}" for i in range(CHECKPOINT_MESSAGES)]
    assert committed == ["B"]


def test_a_two_phase_runner_restoring_behind_the_committed_checkpoints_is_refused(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """Runner B loaded its checkpoint (none) before runner A committed checkpoint 1: replaying
    from there would write checkpoint 1's input again. B's restore refuses, loudly."""
    from onceflow.client import Message

    kind = "pg-2pc"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "stale")
    prepare_target(kind, env, job)
    a, _ = make_sink(kind, env, job)
    b, _ = make_sink(kind, env, job)
    a.on_checkpoint_restore(None)
    a.on_checkpoint_start(1)
    a.write([Message(input_stream(job), {"id": 1, "v": "value-1"}, "-1", "x", 0)])
    a.on_checkpoint_complete(Checkpoint(1, {input_stream(job): "x"}, {}, a.on_checkpoint_prepare(1)))
    with pytest.raises(SinkFencedError, match="checkpoint 1"):
        b.on_checkpoint_restore(None)
    a.close()
    b.close()
    assert read_target(kind, env, job) == ["1:value-1"]


def test_a_two_phase_restore_waits_for_a_checkpoint_holding_the_job_then_gives_up_loudly(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """Another runner's checkpoint transaction holds the job's epoch row (step 3 of the fencing)
    and is never decided: the restore waits ``lock_timeout``, then fails with SinkError instead of
    hanging; once the row is free, a restore claims the job."""
    import psycopg

    from onceflow.sinks import PostgresTwoPhaseSink, SinkError

    kind = "pg-2pc"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "held")
    prepare_target(kind, env, job)
    first, _ = make_sink(kind, env, job)
    first.on_checkpoint_restore(None)  # creates the tables, claims epoch 1
    first.close()
    assert env.pg is not None
    sink = PostgresTwoPhaseSink(env.pg, table(job), ["id", "v"], job=job, lock_timeout=0.2)
    with psycopg.connect(env.pg) as holder:
        holder.execute("SELECT epoch FROM onceflow_sink_epochs WHERE job = %s FOR UPDATE", (job,))
        with pytest.raises(SinkError, match="held the job"):
            sink.on_checkpoint_restore(None)
        holder.rollback()
    sink.on_checkpoint_restore(None)
    assert sink.epoch == 2
    sink.close()


def test_outbox_zombie_is_fenced_by_the_restarted_writer(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    kind = "outbox"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "zombie")
    tail = populate(kind, env, job)
    zombie, _ = make_sink(kind, env, job)
    assert isinstance(zombie, OutboxSink)
    zombie.on_checkpoint_restore(None)
    from onceflow.client import Message, ProducerFencedError

    zombie.write([Message(input_stream(job), {"id": 999, "v": "zombie"}, "-1", "x", 0)])
    zombie.on_checkpoint_prepare(1)
    run_to_end(kind, env, job)  # its init fences the zombie and aborts the zombie's open transaction
    with pytest.raises(ProducerFencedError):
        zombie.on_checkpoint_complete(Checkpoint(1, {input_stream(job): tail}, {}, None, True))
    zombie.close()
    check_exact(kind, env, job, tail, receiver)


def test_checkpoint_store_records_each_commit(
    request: pytest.FixtureRequest, onceflow_url: str, tmp_path: Path, receiver: HookReceiver
) -> None:
    """The 2PC checkpoint carries the transaction handle, and ends marked sink_committed."""
    kind = "pg-2pc"
    env = make_env(kind, request, onceflow_url, tmp_path, receiver)
    job = new_job(kind, "store")
    tail = populate(kind, env, job)
    prepare_target(kind, env, job)
    stats = run_to_end(kind, env, job)
    cp = FileCheckpointStore(Path(env.work) / f"{job}.checkpoints.json").load(job)
    assert cp is not None and stats.checkpoints == 6
    assert (cp.id, cp.sink_committed, cp.offsets, cp.handle) == (
        6,
        True,
        {input_stream(job): tail},
        {"gid": f"onceflow:{job}:6", "checkpoint": 6},
    )
    second = run_to_end(kind, env, job)
    assert (second.restored, second.checkpoints, second.messages) == (6, 0, 0)
    check_exact(kind, env, job, tail, receiver)


def test_webhook_effects_require_webhook_objects(onceflow_url: str) -> None:
    sink = OutboxSink(
        onceflow_url, "outbox-misuse", group="g", transactional_id="t", effects=lambda m: [{"url": "http://x"}]
    )  # type: ignore[list-item]
    from onceflow.client import Message
    from onceflow.sinks import SinkError

    with pytest.raises(SinkError, match="Webhook objects"):
        sink._entries(Message("s", {}, "-1", "x", 0))
    assert Webhook("http://x", {}).method == "POST"
