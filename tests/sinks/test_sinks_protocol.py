"""The exactly-once sink's protocol, in process (no Spark): ``/v1/sinks/<id>`` and ``onceflow.spark.protocol``.

Each test names the hole it closes (issue 14) or the suspicion it proves or disproves.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from helpers.servers import InProcess
from helpers.txn import S, Txn, committed, kill, make, serve

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


# ---------------------------------------------------------------------- the protocol, driven without Spark

from onceflow.client._errors import OnceflowError  # noqa: E402
from onceflow.spark.protocol import (  # noqa: E402
    Fingerprint,
    SinkTask,
    TaskResult,
    TaskSpec,
    WriterSettings,
    abort_batch,
    commit_batch,
    run_task,
    task_name,
)

URL = "http://testserver"  # the fixture's in-process client


def settings(sink: str = "s", **kw: Any) -> WriterSettings:
    return WriterSettings(url=URL, sink=sink, request_deadline=5.0, **kw)


def rows(*ids: int, stream: str = "out") -> list[dict[str, list[bytes]]]:
    return [{stream: [f'{{"id": {i}}}'.encode() for i in ids]}]


async def batch(
    c: InProcess, st: WriterSettings, query: str | None, n: int | None, parts: list[list[int]], run: str = "r1"
) -> str:
    """One whole batch: a task per list of ids, then the driver's commit. Returns its status."""
    results = [
        await run_task(c.client, st, TaskSpec(n, query, p, task_name(run, 0, 100 * (n or 0) + p)), rows(*ids))
        for p, ids in enumerate(parts)
    ]
    return (await commit_batch(c.client, st, n, results)).status


async def ids(c: InProcess, stream: str = "out") -> list[int]:
    return sorted(m["id"] for m in await committed(c, stream))


async def settled(c: InProcess, stream: str = "out") -> bool:
    """No transaction left open in ``stream``: its last stable offset is its tail."""
    head = await c.client.head(S + stream)
    return bool(head.headers["stream-last-stable-offset"] == head.headers["stream-next-offset"])


async def test_the_protocol_module_imports_neither_pyspark_nor_pyarrow() -> None:
    import subprocess
    import sys

    code = (
        "import sys, onceflow.spark.protocol; "
        "bad = [m for m in ('pyspark', 'pyarrow') if m in sys.modules]; assert not bad, bad"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


async def test_a_lost_commit_answer_is_retried_and_told_committed(onceflow: InProcess) -> None:
    """Item 1 through the protocol: the driver's commit reaches the server, its answer is lost,
    the retry is answered committed (a batch write without batch id)."""
    import httpx

    inner = onceflow.client._transport
    lost: list[str] = []

    class LoseFirstCommitAnswer(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            resp = await inner.handle_async_request(request)
            if request.url.path.endswith("/commit") and not lost:
                lost.append(request.url.path)
                raise httpx.ReadTimeout("answer lost", request=request)
            return resp

    async with httpx.AsyncClient(transport=LoseFirstCommitAnswer(), base_url=URL) as client:
        st = settings("job-1")
        results = [await run_task(client, st, TaskSpec(None, None, p, task_name("r", 0, p)), rows(p)) for p in range(2)]
        outcome = await commit_batch(client, st, None, results)
    assert lost and outcome.status == "committed"
    assert await ids(onceflow) == [0, 1]


# ---------------------------------------------------------------------- 2. the sink's identity


async def test_a_new_checkpoint_under_a_used_sink_id_is_refused_loudly(onceflow: InProcess) -> None:
    """Query Q1 committed batches 0 and 1; query Q2 (a new checkpoint: batch ids from 0) writes
    under the same sinkId. Its tasks must fail with a message naming the sink, its last batch,
    its query and how to reset it, not skip the batch as already committed."""
    await make(onceflow, "out")
    st = settings("orders")
    assert await batch(onceflow, st, "Q1", 0, [[0, 1], [2]]) == "committed"
    assert await batch(onceflow, st, "Q1", 1, [[3]]) == "committed"
    with pytest.raises(OnceflowError) as refused:
        await batch(onceflow, st, "Q2", 0, [[10, 11]], run="r2")
    message = str(refused.value)
    assert refused.value.status == 409
    for needle in (
        "sink 'orders'",
        "belongs to query Q1",
        "last committed batch: 1",
        "query Q2",
        "/v1/sinks/orders/reset",
    ):
        assert needle in message
    assert await ids(onceflow) == [0, 1, 2, 3]
    assert await settled(onceflow)
    # the same query after a restart (another run, same query id) replays as before: nothing added
    assert await batch(onceflow, st, "Q1", 1, [[3]], run="r3") == "already_committed"
    assert await ids(onceflow) == [0, 1, 2, 3]


async def test_two_queries_under_one_sink_id_cannot_abort_each_others_transactions(onceflow: InProcess) -> None:
    await make(onceflow, "out")
    st = settings("orders")
    assert await batch(onceflow, st, "Q1", 0, [[0]]) == "committed"
    # Q1's task of batch 1 has written and waits for its driver
    mine = await run_task(onceflow.client, st, TaskSpec(1, "Q1", 0, task_name("r1", 0, 7)), rows(1))
    # Q2 (same sinkId, same partition and attempt number) starts, fails, and its driver aborts
    with pytest.raises(OnceflowError, match="belongs to query Q1"):
        await run_task(onceflow.client, st, TaskSpec(0, "Q2", 0, task_name("r2", 0, 7)), rows(99))
    await abort_batch(onceflow.client, st, 0, [None])
    assert (await commit_batch(onceflow.client, st, 1, [mine])).status == "committed"
    assert await ids(onceflow) == [0, 1]
    assert await settled(onceflow)


async def test_another_query_naming_the_owners_tasks_touches_nothing(onceflow: InProcess) -> None:
    """Even a body that names the owner's open task transactions cannot abort or commit them."""
    await make(onceflow, "out")
    st = settings("orders")
    assert await batch(onceflow, st, "Q1", 0, [[0]]) == "committed"
    mine = await run_task(onceflow.client, st, TaskSpec(1, "Q1", 0, task_name("r1", 0, 7)), rows(1))
    named = {"members": [mine.member()], "abort_prefix": "spark/orders/", "batch": 1, "query": "Q2"}
    assert (await onceflow.client.post("/v1/sinks/orders/abort", json=named)).status_code == 200
    stolen = await onceflow.client.post("/v1/sinks/orders/commit", json=named)
    assert stolen.status_code == 409 and stolen.json()["error"]["code"] == "sink_owned"
    assert await ids(onceflow) == [0]
    assert (await commit_batch(onceflow.client, st, 1, [mine])).status == "committed"
    assert await ids(onceflow) == [0, 1]


async def test_tasks_commits_and_aborts_of_one_sink_at_once_all_finish(onceflow: InProcess) -> None:
    """One lock order under load: tasks of two batches begin and write while a commit and an
    abort run (a paused driver and its replacement); everything finishes, nothing stays open."""
    await make(onceflow, "out")
    st = settings("busy")
    first = [await run_task(onceflow.client, st, TaskSpec(0, "Q", p, task_name("r", 0, p)), rows(p)) for p in range(4)]

    async def late(p: int) -> None:
        with contextlib.suppress(OnceflowError):  # fenced or told the batch is done: both fine
            await run_task(onceflow.client, st, TaskSpec(0, "Q", p, task_name("r", 1, 100 + p)), rows(50 + p))

    work = [
        commit_batch(onceflow.client, st, 0, first[:2]),
        abort_batch(onceflow.client, st, 0, first[2:]),
        *(late(p) for p in range(4)),
    ]
    outcomes = await asyncio.wait_for(asyncio.gather(*work, return_exceptions=True), timeout=30)
    assert not [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, OnceflowError)]
    got = await ids(onceflow)
    assert got in ([], [0, 1])  # the commit went first (then the abort found nothing of it) or failed
    await abort_batch(onceflow.client, st, 0, first)  # whatever is left: the driver's abort
    assert await settled(onceflow)


async def test_two_new_queries_racing_for_one_sink_id_leave_one_owner_and_no_loss(onceflow: InProcess) -> None:
    """Before any commit both queries may begin; the first commit binds the sink, the other is
    refused and aborts only its own tasks."""
    await make(onceflow, "out")
    st = settings("fresh")
    a = await run_task(onceflow.client, st, TaskSpec(0, "QA", 0, task_name("ra", 0, 1)), rows(1))
    b = await run_task(onceflow.client, st, TaskSpec(0, "QB", 0, task_name("rb", 0, 1)), rows(2))
    assert a.transactional_id != b.transactional_id
    assert (await commit_batch(onceflow.client, st, 0, [a])).status == "committed"
    with pytest.raises(OnceflowError, match="belongs to query QA"):
        await commit_batch(onceflow.client, st, 0, [b])
    await abort_batch(onceflow.client, st, 0, [b])
    assert await ids(onceflow) == [1]
    assert await settled(onceflow)
    assert (await onceflow.client.get("/v1/sinks/fresh")).json() == {
        "sink": "fresh",
        "batch": 0,
        "owner": "QA",
        "rows": 1,
    }


async def test_a_reset_is_explicit_and_names_the_owner_it_resets(onceflow: InProcess) -> None:
    await make(onceflow, "out")
    st = settings("orders")
    assert await batch(onceflow, st, "Q1", 0, [[0]]) == "committed"
    no_owner = await onceflow.client.post("/v1/sinks/orders/reset", json={})
    assert no_owner.status_code == 400
    wrong = await onceflow.client.post("/v1/sinks/orders/reset", json={"owner": "Q2"})
    assert wrong.status_code == 409 and "belongs to query Q1" in wrong.json()["error"]["message"]
    r = await onceflow.client.post("/v1/sinks/orders/reset", json={"owner": "Q1"})
    assert r.status_code == 200, r.text
    assert (await onceflow.client.get("/v1/sinks/orders")).json() == {
        "sink": "orders",
        "batch": None,
        "owner": None,
        "rows": None,
    }
    assert (
        await onceflow.client.post("/v1/sinks/orders/reset", json={"owner": "Q1"})
    ).status_code == 200  # a retry: no-op
    assert await batch(onceflow, st, "Q2", 0, [[10]], run="r2") == "committed"
    assert await ids(onceflow) == [0, 10]
    # the old query, still running by mistake, is now the one refused
    with pytest.raises(OnceflowError, match="belongs to query Q2"):
        await batch(onceflow, st, "Q1", 1, [[1]])


async def test_the_sink_record_survives_a_restart_and_a_compaction(onceflow: InProcess) -> None:
    await make(onceflow, "out", "other")
    st = settings("orders")
    assert await batch(onceflow, st, "Q1", 4, [[0]]) == "committed"
    job = settings("job-9")
    assert await batch(onceflow, job, None, None, [[1]]) == "committed"
    reset = settings("gone")
    assert await batch(onceflow, reset, "Q7", 0, [[2]]) == "committed"
    coord = onceflow.broker.coordinator
    tasks = {t for t in coord.txns if t.startswith("spark/")}
    assert any(t.startswith("spark/gone/") for t in tasks)
    assert (await onceflow.client.post("/v1/sinks/gone/reset", json={"owner": "Q7"})).status_code == 200
    before = dict(coord.sinks)
    assert set(before) == {"orders", "job-9"}
    # the reset sink's task ids went with it (issue 28, item 3: nothing a client makes outlives it)
    kept = {t for t in tasks if not t.startswith("spark/gone/")}
    assert {t for t in coord.txns if t.startswith("spark/")} == kept
    from onceflow.core.coordinator import Coordinator

    for compact in (False, True):
        again = Coordinator(
            coord.directory, policy=coord.policy, compact_bytes=0 if compact else 64 << 20, fs=onceflow.broker.fs
        )
        again.open()
        assert again.sinks == before
        assert {t for t in again.txns if t.startswith("spark/")} == kept
        assert again.epoch_floor == coord.epoch_floor > 0
        await again.close()


# ---------------------------------------------------------------------- 4. suspicions


async def test_a_slow_task_does_not_let_the_timeout_abort_the_batchs_finished_tasks(onceflow: InProcess) -> None:
    """4a (proved, fixed): the fast task's transaction is open from its first row until the
    driver's commit, which waits for the slowest task. Outlasting transactionTimeoutMs aborted it
    (and fenced it), so the commit failed, and the replay (same range, same slow task) again."""
    await make(onceflow, "out")
    st = settings("slow", transaction_timeout_ms=1000)
    coord = onceflow.broker.coordinator
    fast = await run_task(onceflow.client, st, TaskSpec(0, "Q", 0, task_name("r", 0, 1)), rows(0))
    slow = await SinkTask.begin(onceflow.client, st, TaskSpec(0, "Q", 1, task_name("r", 0, 2)))
    await slow.write(rows(1)[0])
    meta = coord.txns[fast.transactional_id]
    aged = meta.started - 3600.0  # an hour has passed for the fast task's transaction
    meta.started = aged
    for _ in range(200):  # the slow task, still at work, says so
        if meta.started > aged:
            break
        await asyncio.sleep(0.05)
    await coord.expire()
    result = await slow.finish()
    assert (await commit_batch(onceflow.client, st, 0, [fast, result])).status == "committed"
    assert await ids(onceflow) == [0, 1]


async def test_a_batch_whose_tasks_and_driver_are_gone_is_still_aborted_by_the_timeout(onceflow: InProcess) -> None:
    """The other side of 4a: once no task of the batch is at work, nothing keeps its transactions."""
    await make(onceflow, "out")
    st = settings("gone", transaction_timeout_ms=1000)
    coord = onceflow.broker.coordinator
    done = await run_task(onceflow.client, st, TaskSpec(0, "Q", 0, task_name("r", 0, 1)), rows(0))
    coord.txns[done.transactional_id].started -= 3600.0
    assert await coord.expire() == [done.transactional_id]
    assert await settled(onceflow)


async def test_a_late_attempt_cannot_hold_the_lso_after_its_batch_committed(onceflow: InProcess) -> None:
    """4b (proved, fixed): a speculative attempt that began before the commit and writes after it
    opened a transaction that held the last stable offset until the next batch or the timeout.
    Its batch's commit now fences it: its rows are refused."""
    await make(onceflow, "out")
    st = settings("late")
    used = await run_task(onceflow.client, st, TaskSpec(3, "Q", 0, task_name("r", 0, 1)), rows(0))
    late = await SinkTask.begin(onceflow.client, st, TaskSpec(3, "Q", 0, task_name("r", 1, 2)))
    assert (await commit_batch(onceflow.client, st, 3, [used])).status == "committed"
    with pytest.raises(OnceflowError) as fenced:
        await late.write(rows(0)[0])
        await late.finish()
    assert fenced.value.status == 403
    await late.abandon()
    assert await ids(onceflow) == [0]
    assert await settled(onceflow)
    # one that begins after the commit is told the batch is done and writes nothing
    later = await run_task(onceflow.client, st, TaskSpec(3, "Q", 0, task_name("r", 2, 3)), rows(0))
    assert later.skipped and later.member() is None
    assert await settled(onceflow)


async def test_attempts_of_two_stage_attempts_do_not_collide(onceflow: InProcess) -> None:
    """4c (proved, fixed): a retried stage numbers its task attempts from 0 again, and a zombie
    attempt of the first stage attempt may still run. Ids built from attemptNumber() collided:
    the second init fenced the attempt whose result Spark used, and the batch failed."""
    await make(onceflow, "out")
    st = settings("stages")
    first = await run_task(onceflow.client, st, TaskSpec(0, "Q", 0, task_name("r", 0, 11)), rows(0))
    zombie = await run_task(onceflow.client, st, TaskSpec(0, "Q", 0, task_name("r", 0, 42)), rows(0))
    assert first.transactional_id != zombie.transactional_id
    assert (await commit_batch(onceflow.client, st, 0, [first])).status == "committed"
    assert await ids(onceflow) == [0]
    assert await settled(onceflow)


async def test_a_batch_id_replayed_over_other_input_is_refused_not_skipped(onceflow: InProcess) -> None:
    """4d (proved, fixed): batch 0 committed with rows 0..2; the query replays batch 0 planned
    over another range (a lost offset log): skipping it on its id alone loses rows 3 and 4.
    The replay reports a fingerprint of its rows, and a different one is refused."""
    await make(onceflow, "out")
    st = settings("replan")
    assert await batch(onceflow, st, "Q", 0, [[0, 1], [2]]) == "committed"
    with pytest.raises(OnceflowError) as refused:
        await batch(onceflow, st, "Q", 0, [[0, 1, 2], [3, 4]], run="r2")
    assert refused.value.status == 409 and "replayed with rows" in str(refused.value)
    # the same rows, split otherwise among the tasks, are the same batch: skipped as before
    assert await batch(onceflow, st, "Q", 0, [[2, 1], [0]], run="r3") == "already_committed"
    assert await ids(onceflow) == [0, 1, 2]
    assert await settled(onceflow)
    # the check can be turned off (a query whose output is not deterministic)
    unchecked = settings("replan", verify_replay=False)
    assert await batch(onceflow, unchecked, "Q", 0, [[7]], run="r4") == "already_committed"


async def test_a_retried_begin_gets_the_same_transaction_and_fences_nothing(onceflow: InProcess) -> None:
    """The begin's answer lost: the retry (same task name) must not fence the task itself."""
    await make(onceflow, "out")
    st = settings("retry")
    spec = TaskSpec(0, "Q", 0, task_name("r", 0, 5))
    first = await SinkTask.begin(onceflow.client, st, spec)
    again = await SinkTask.begin(onceflow.client, st, spec)
    assert (first.transactional_id, first.epoch) == (again.transactional_id, again.epoch)
    await again.write(rows(0)[0])
    result = await again.finish()
    await first.abandon()
    assert (await commit_batch(onceflow.client, st, 0, [result])).status == "committed"
    assert await ids(onceflow) == [0]


def test_task_results_are_plain_picklable_values() -> None:
    import pickle

    r = TaskResult("s", 1, "Q", 0, "spark/s/p0/s0", 2, 1, 3, False, Fingerprint(3, 12345))
    assert pickle.loads(pickle.dumps(r)) == r  # noqa: S301 - our own bytes


async def test_a_task_stops_its_keep_alive_even_if_a_cancel_is_swallowed(onceflow: InProcess) -> None:
    """Found by ``onceflow sim`` (seed 1593): the keep-alive's cancel arrived as its request was
    answered and was lost (asyncio.wait_for on Python 3.11 can do that), so the keep-alive looped
    for ever and ``abandon()``, awaiting it, never returned: the Spark task hung."""
    await make(onceflow, "out")
    st = settings("alive", transaction_timeout_ms=200)
    task = await SinkTask.begin(onceflow.client, st, TaskSpec(0, "Q", 0, task_name("r", 0, 1)))
    import httpx

    swallowed = 0

    async def post(*a: Any, **k: Any) -> Any:
        nonlocal swallowed
        try:
            await asyncio.sleep(3600)  # a keep-alive whose answer is slow to come
        except asyncio.CancelledError:
            swallowed += 1  # the cancel is lost, as wait_for can lose it
        return httpx.Response(200)

    task.client = _Posting(onceflow.client, post)  # type: ignore[assignment]
    await asyncio.sleep(0.3)  # a keep-alive is under way
    await asyncio.wait_for(task.abandon(), 10)
    assert swallowed == 1


class _Posting:
    """An httpx client whose ``post`` is replaced."""

    def __init__(self, client: Any, post: Any) -> None:
        self._client = client
        self.post = post

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


async def test_the_sink_shows_how_many_rows_its_last_batch_published(tmp_path: Path) -> None:
    """The driver's commit counts the rows its tasks wrote; the sink keeps the count of its last
    committed batch (for the dashboard and ``onceflow sinks``), also after a restart, and a
    replayed batch changes nothing."""
    st = settings("counted")
    async with serve(tmp_path / "data") as c:
        await make(c, "out")
        assert await batch(c, st, "Q", 0, [[1, 2, 3], [4, 5]]) == "committed"
        assert (await c.client.get("/v1/sinks/counted")).json()["rows"] == 5
        assert await batch(c, st, "Q", 1, [[6], []]) == "committed"
        assert await batch(c, st, "Q", 1, [[6], []], run="r2") == "already_committed"
        bad = await c.client.post("/v1/sinks/counted/commit", json={"members": [], "rows": -1})
        assert bad.status_code == 400 and "rows" in bad.json()["error"]["message"]
        await kill(c.broker)
    async with serve(tmp_path / "data") as c:
        assert (await c.client.get("/v1/sinks/counted")).json() == {
            "sink": "counted",
            "batch": 1,
            "owner": "Q",
            "rows": 1,
        }
        await c.broker.close()


def test_a_fingerprint_is_the_sum_of_each_rows_crc32_whatever_the_split_or_order() -> None:
    """What a server keeps from an earlier commit must match what a replay computes now: the row
    count and the sum (mod 2**64) of CRC-32s of ``stream NUL value``, from a list or any iterable."""
    import zlib

    rows = [b'{"a":%d}' % i for i in range(50)] + [b"", b"\xff" * 300]
    expected = sum(zlib.crc32(b"out\0" + v) for v in rows) & 0xFFFF_FFFF_FFFF_FFFF
    whole = Fingerprint().add("out", rows)
    assert whole == Fingerprint(len(rows), expected)
    assert Fingerprint().add("out", rows[30:]) + Fingerprint().add("out", iter(rows[:30][::-1])) == whole
    assert Fingerprint().add("other", rows) != whole
