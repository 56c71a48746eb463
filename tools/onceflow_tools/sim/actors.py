"""The clients of a simulation: real onceflow client code on the simulated network.

Each actor records what it does and what it was told in the history format of
:mod:`onceflow_tools.chaos.history`, so one checker judges chaos runs and simulations alike. Values are
unique strings (actor, a counter), so a value names the write that made it.

- :func:`idempotent_producer`: :class:`~onceflow.client.AsyncIdempotentProducer`, flushes now and
  then; a producer that gives up is replaced by a new instance with a higher epoch.
- :func:`transactional_producer`: :class:`~onceflow.client.AsyncTransactionalProducer` over one or
  two streams, committing about three in four, aborting the rest, aborting after any error; a
  fenced or failed instance is replaced (``init`` again).
- :func:`copier`: consume-transform-produce: reads its inputs read_committed from the group's
  committed offsets, writes each value to an output inside a transaction that also carries the
  group's new offsets (``send_offsets_to_transaction``), commits.
- :func:`reader`: read_committed ``format=records`` reads of every stream, recorded.
- :func:`forker`: forks a transactional stream at its tail (sometimes mid-batch, with
  ``Stream-Fork-Sub-Offset``) while transactions are open in it, and reads the fork read_committed.
- :func:`spark_sink`: the Spark sink's driver/task protocol for a streaming query (tasks write in
  their own transactions, the driver commits them as one decision with the batch id), with driver
  crashes that replay a batch, and sometimes a second checkpoint (batch ids from 0 again) or a
  second driver under the same sink id; and a batch (non-streaming) job that is re-run when it
  fails, as a user would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
from collections.abc import Callable, Coroutine
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from onceflow.client import OnceflowError
from onceflow.client.producer import AsyncIdempotentProducer
from onceflow.client.transactions import AsyncTransactionalProducer
from onceflow.spark.protocol import TaskResult, TaskSpec, WriterSettings, abort_batch, commit_batch, run_task, task_name

from ..chaos.worker import parse_records

__all__ = ["ACTORS", "Env"]

URL = "http://onceflow.sim"
# the longest a request can take to reach the node and be served: the network's slowest delay
# and a duplicate's extra delay (world.NetFaults, SimTransport), plus room for the server's own
LATE_COPY = 10.0
JSON = {"content-type": "application/json"}


class Env(Protocol):
    """What an actor gets from the world."""

    rng: random.Random
    txn_timeout: float

    def client(self, name: str) -> httpx.AsyncClient: ...
    def record(self, client: str, op: str, **fields: Any) -> None: ...
    def trace(self, who: str, what: str) -> None: ...
    def anomaly(self, kind: str, stream: str | None, detail: str) -> None: ...
    def crashes(self) -> int: ...
    def stopping(self, late: bool = False) -> bool: ...


def surl(stream: str) -> str:
    return f"{URL}/v1/stream/{quote(stream, safe='/')}"


async def nap(env: Env, lo: float = 0.01, hi: float = 0.2) -> None:
    await asyncio.sleep(env.rng.uniform(lo, hi))


async def ensure_stream(c: httpx.AsyncClient, env: Env, stream: str) -> None:
    while True:
        try:
            r = await c.put(surl(stream), headers=JSON)
            if r.status_code in (200, 201):
                return
        except httpx.TransportError:
            pass
        await nap(env, 0.05, 0.3)


async def read_records(c: httpx.AsyncClient, stream: str, start: str) -> tuple[str, list[list[Any]]] | None:
    """One read_committed ``format=records`` read: (next offset, [[offset, value], ...]) or None."""
    try:
        r = await c.get(surl(stream), params={"offset": start, "format": "records", "isolation": "read_committed"})
    except httpx.TransportError:
        return None
    if r.status_code != 200:
        return None
    return r.headers["stream-next-offset"], parse_records(r.content)


# ---------------------------------------------------------------------- idempotent producer


async def idempotent_producer(env: Env, name: str, stream: str) -> None:
    c = env.client(name)
    await ensure_stream(c, env, stream)
    epoch, n = 0, 0
    while not env.stopping():
        producer = AsyncIdempotentProducer(
            URL,
            stream,
            producer_id=name,
            epoch=epoch,
            content_type="application/json",
            client=c,
            delivery_timeout=env.rng.uniform(2.0, 6.0),
            max_in_flight=env.rng.randint(1, 3),
            retry_backoff=(0.02, 0.5),
        )
        await producer.start()
        pending: list[int] = []
        try:
            while not env.stopping():
                values = [f"{name}:{epoch}:{n + i}" for i in range(env.rng.randint(1, 3))]
                n += len(values)
                ident = n  # unique: n only grows
                env.record(name, "append", id=ident, stream=stream, values=values)
                pending.append(ident)
                producer.extend(values)
                if env.rng.random() < 0.4:
                    await producer.flush()
                    for i in pending:
                        env.record(name, "ack", id=i, outcome="ok")
                    pending.clear()
                await nap(env)
            await producer.flush()
            for i in pending:
                env.record(name, "ack", id=i, outcome="ok")
            pending.clear()
        except OnceflowError as exc:
            env.trace(name, f"producer epoch {epoch} gave up: {exc}")
            epoch += 1  # a restarted producer; what was not acknowledged stays indeterminate
        finally:
            await producer.close()


# ---------------------------------------------------------------------- transactional producer


async def transactional_producer(env: Env, name: str, streams: list[str]) -> None:
    """One instance at a time holds the id ``name``, so the server has no reason to fence it but
    a transaction of its own that outlived the timeout or a crash of the server: a fence on the
    first append of a transaction, answered sooner than the timeout after it was sent, after the
    previous transaction was confirmed ended and with no crash since, is reported
    (``spurious-fence``). So is a fence that an init of its own may have made: one that failed
    without an answer can still land, late, after a later init, and begin the next epoch (the
    server cannot tell it from a new instance's; Kafka's InitProducerId races the same way)."""
    c = env.client(name)
    for s in streams:
        await ensure_stream(c, env, s)
    k = 0
    unanswered = -LATE_COPY  # when an init of this id last failed: a copy of it may land until LATE_COPY after
    while not env.stopping():
        producer = AsyncTransactionalProducer(
            URL,
            name,
            client=c,
            timeout_ms=int(env.txn_timeout * 1000),
            delivery_timeout=env.rng.uniform(1.0, 4.0),
            retry_backoff=(0.02, 0.3),
        )
        try:
            await producer.init()
        except OnceflowError as exc:
            env.trace(name, f"init failed: {exc}")
            unanswered = env_time(env)
            await nap(env, 0.1, 0.5)
            continue
        clean: int | None = env.crashes()  # crashes seen when the last transaction was confirmed ended
        try:
            while not env.stopping():
                k += 1
                label = f"{name}.{k}"
                commit = env.rng.random() < 0.75
                first = True
                try:
                    m = 0
                    for _ in range(env.rng.randint(1, 3)):
                        stream = env.rng.choice(streams)
                        values = [f"{label}:{m + i}" for i in range(env.rng.randint(1, 3))]
                        m += len(values)
                        env.record(name, "append", id=k, stream=stream, values=values, txn=label)
                        sent = env_time(env)
                        try:
                            await producer.extend(stream, values)
                            if first or env.rng.random() < 0.5:
                                await producer.flush()
                        except OnceflowError as exc:
                            quick = env_time(env) - sent < env.txn_timeout  # not open long enough to time out
                            if (
                                first
                                and quick
                                and clean == env.crashes()
                                and sent - unanswered > LATE_COPY
                                and (exc.status == 403 or exc.code == "transaction_aborted")
                            ):
                                env.anomaly(
                                    "spurious-fence",
                                    stream,
                                    f"{name}: fenced on the first append of {label}, "
                                    f"though its last transaction was confirmed ended and the server did not "
                                    f"restart since: {exc}",
                                )
                            raise
                        first = False
                        await nap(env, 0.0, 0.1)
                except OnceflowError as exc:
                    env.trace(name, f"{label}: append failed ({exc}); aborting")
                    commit = False
                    if exc.status == 403 or exc.code == "transaction_aborted":
                        env.record(name, "txn", txn=label, decision="abort", outcome="unknown")
                        break  # fenced: this instance can do nothing more; a new one inits
                try:
                    if commit:
                        await producer.commit()
                    else:
                        await producer.abort()
                except OnceflowError as exc:
                    env.record(name, "txn", txn=label, decision="commit" if commit else "abort", outcome="unknown")
                    env.trace(name, f"{label}: {'commit' if commit else 'abort'} failed: {exc}")
                    break  # a new instance (init) settles whatever this one left
                if producer.fenced:  # its abort found it fenced: what it left open was aborted for it
                    env.record(name, "txn", txn=label, decision="abort", outcome="unknown")
                    break
                env.record(name, "txn", txn=label, decision="commit" if commit else "abort", outcome="ok")
                clean = env.crashes()
                if env.rng.random() < 0.08:
                    await asyncio.sleep(env.txn_timeout * env.rng.uniform(1.2, 2.0))  # idle past the timeout
                else:
                    await nap(env)
        finally:
            await producer.close()


# ---------------------------------------------------------------------- copier


async def copier(env: Env, name: str, inputs: list[str], outputs: list[str], group: str) -> None:
    c = env.client(name)
    for s in inputs + outputs:
        await ensure_stream(c, env, s)
    env.record(name, "copy", inputs=inputs, outputs=outputs)
    caught_up = False
    while not caught_up:  # after the others stop, it goes on until it has copied everything
        producer = AsyncTransactionalProducer(
            URL,
            name,
            client=c,
            timeout_ms=int(env.txn_timeout * 1000),
            delivery_timeout=env.rng.uniform(1.0, 4.0),
            retry_backoff=(0.02, 0.3),
        )
        try:
            await producer.init()
            sent = env_time(env)
            r = await c.get(f"{URL}/v1/groups/{group}/offsets")
            if r.status_code != 200:
                raise OnceflowError(f"offsets of {group}: {r.status_code}")
            env.record(name, "fetch-offsets", group=group, offsets=r.json()["offsets"], t0=sent)
            positions = {s: r.json()["offsets"].get(s, "-1") for s in inputs}
            while True:
                stopping = env.stopping(late=True)
                moved: dict[str, str] = {}
                for s in inputs:
                    got = await read_records(c, s, positions[s])
                    if got is None:
                        raise OnceflowError(f"read of {s} failed")
                    nxt, records = got
                    env.record(
                        name,
                        "read",
                        stream=s,
                        isolation="read_committed",
                        start=positions[s],
                        next=nxt,
                        records=records,
                    )
                    for _off, value in records:
                        await producer.append(outputs[hash_pick(value, len(outputs))], value)
                    if nxt != positions[s]:
                        moved[s] = nxt
                if not moved:
                    if stopping:
                        caught_up = True
                        break
                    await nap(env, 0.05, 0.3)
                    continue
                await producer.send_offsets_to_transaction(group, moved)
                try:
                    await producer.commit()
                except OnceflowError as exc:
                    for st, off in moved.items():
                        env.record(name, "commit-offset", group=group, stream=st, offset=off, outcome="unknown")
                    if exc.status == 403 or env.rng.random() < 0.5:
                        raise
                    # some users carry on with the same producer: abort (which may fail too) and
                    # start over from the committed offsets
                    env.trace(name, f"commit failed ({exc}); aborting and carrying on")
                    with contextlib.suppress(OnceflowError):
                        await producer.abort()
                    r = await c.get(f"{URL}/v1/groups/{group}/offsets")
                    if r.status_code != 200:
                        raise
                    positions = {s: r.json()["offsets"].get(s, "-1") for s in inputs}
                    continue
                for st, off in moved.items():
                    env.record(name, "commit-offset", group=group, stream=st, offset=off, outcome="ok")
                positions.update(moved)
                await nap(env, 0.0, 0.1)
        except (OnceflowError, httpx.TransportError, KeyError, ValueError) as exc:
            env.trace(name, f"restarting after: {exc}")
            await nap(env, 0.05, 0.3)
        finally:
            await producer.close()


def env_time(env: Env) -> float:
    return asyncio.get_running_loop().time()


def hash_pick(value: Any, n: int) -> int:
    return sum(json.dumps(value).encode()) % n


# ---------------------------------------------------------------------- readers


async def reader(env: Env, name: str, streams: list[str]) -> None:
    c = env.client(name)
    at = dict.fromkeys(streams, "-1")
    while not env.stopping():
        s = env.rng.choice(streams)
        got = await read_records(c, s, at[s])
        if got is not None:
            nxt, records = got
            env.record(name, "read", stream=s, isolation="read_committed", start=at[s], next=nxt, records=records)
            at[s] = nxt
        await nap(env, 0.02, 0.3)


async def group_member(env: Env, name: str, streams: list[str], group: str) -> None:
    """A consumer-group member that commits its offsets outside transactions (``POST
    /v1/groups/<g>/offsets``) and reads them back after every restart; the group's committed
    offsets must never be seen moving back."""
    c = env.client(name)
    epoch = 0
    while not env.stopping():
        epoch += 1  # a restarted member: a newer member epoch fences an older one
        sent = env_time(env)
        try:
            r = await c.get(f"{URL}/v1/groups/{group}/offsets")
        except httpx.TransportError:
            await nap(env)
            continue
        if r.status_code != 200:
            await nap(env)
            continue
        env.record(name, "fetch-offsets", group=group, offsets=r.json()["offsets"], t0=sent)
        at = {s: r.json()["offsets"].get(s, "-1") for s in streams}
        for _ in range(env.rng.randint(3, 12)):
            if env.stopping():
                break
            s = env.rng.choice(streams)
            got = await read_records(c, s, at[s])
            if got is None:
                break
            nxt, records = got
            env.record(name, "read", stream=s, isolation="read_committed", start=at[s], next=nxt, records=records)
            if nxt == at[s]:
                await nap(env)
                continue
            at[s] = nxt
            try:
                cr = await c.post(f"{URL}/v1/groups/{group}/offsets", json={"offsets": {s: nxt}, "member_epoch": epoch})
            except httpx.TransportError:
                env.record(name, "commit-offset", group=group, stream=s, offset=nxt, outcome="unknown")
                break
            env.record(
                name,
                "commit-offset",
                group=group,
                stream=s,
                offset=nxt,
                outcome="ok" if cr.status_code == 200 else "unknown" if cr.status_code >= 500 else "fail",
            )
            if cr.status_code != 200:
                break
            await nap(env)


async def forker(env: Env, name: str, source: str) -> None:
    c = env.client(name)
    n = 0
    while not env.stopping():
        await nap(env, 0.3, 1.5)
        try:
            head = await c.head(surl(source))
        except httpx.TransportError:
            continue
        if head.status_code != 200:
            continue
        n += 1
        fork = f"{source}-fork{n}"
        headers = {**JSON, "stream-forked-from": source}
        if env.rng.random() < 0.3:
            headers["stream-fork-offset"] = head.headers.get(
                "stream-last-stable-offset", head.headers["stream-next-offset"]
            )
            if env.rng.random() < 0.5:
                headers["stream-fork-sub-offset"] = str(env.rng.randint(1, 2))
        try:
            r = await c.put(surl(fork), headers=headers)
        except httpx.TransportError:
            continue
        if r.status_code != 201:
            env.trace(name, f"fork {fork}: {r.status_code} {r.text[:80]}")
            continue
        env.record(name, "fork", stream=fork, source=source)
        at = "-1"
        for _ in range(env.rng.randint(1, 4)):
            got = await read_records(c, fork, at)
            if got is not None:
                nxt, records = got
                env.record(name, "read", stream=fork, isolation="read_committed", start=at, next=nxt, records=records)
                at = nxt
            await nap(env, 0.05, 0.5)


# ---------------------------------------------------------------------- the Spark sink's protocol


def _sink_settings(env: Env, sink: str) -> WriterSettings:
    return WriterSettings(
        URL,
        sink,
        transaction_timeout_ms=int(env.txn_timeout * 1000),
        request_deadline=env.rng.uniform(2.0, 6.0),
        retry_backoff=(0.02, 0.3),
        rng=random.Random(env.rng.getrandbits(32)),
    )


async def _run_tasks(
    env: Env,
    c: httpx.AsyncClient,
    settings: WriterSettings,
    batch: int | None,
    query: str | None,
    run: str,
    counter: list[int],
    rows: list[str],
    stream: str,
) -> list[TaskResult | None]:
    """The batch's two tasks, at once, through the sink's real protocol (spark/protocol.py)."""

    async def task(p: int) -> TaskResult:
        counter[0] += 1
        spec = TaskSpec(batch, query, p, task_name(run, 0, counter[0]))
        mine = [json.dumps(r).encode() for r in rows[p::2]]
        return await run_task(c, settings, spec, [{stream: mine}])

    return list(await asyncio.gather(task(0), task(1)))


async def spark_stream(env: Env, name: str, sink: str, stream: str) -> None:
    """A streaming query through the sink's real protocol (spark/protocol.py): its driver is
    killed now and then (the batch is replayed from the checkpoint, before or after the sink's
    commit), batches fail (the driver's abort), a paused old driver wakes up and aborts the batch
    it was writing, and a late task attempt runs after its batch was decided. With some seeds a
    second checkpoint of the same sink id starts from batch 0 again: the sink must refuse it
    loudly (a 4xx, the user stops that query), never answer it by skipping rows."""
    c = env.client(name)
    await ensure_stream(c, env, stream)
    settings = _sink_settings(env, sink)
    checkpoints = {"q0": 0}
    if env.rng.random() < 0.4:
        checkpoints["q1"] = 0
    attempt = 0
    counter = [0]
    planned: dict[str, list[str]] = {}
    background: set[asyncio.Task[None]] = set()
    while not env.stopping():
        q = "q1" if "q1" in checkpoints and env.rng.random() < 0.3 else "q0"
        query = f"{name}-{q}-id"
        batch = checkpoints[q]
        label = f"{name}/{q}/b{batch}"
        rows = planned.setdefault(
            label, [f"{label}:{i}" for i in range(env.rng.randint(1, 4))]
        )  # a replay: the same rows
        attempt += 1
        run = f"{name}-run{attempt}"
        try:
            env.record(name, "append", id=attempt, stream=stream, values=rows, txn=label)
            results = await _run_tasks(env, c, settings, batch, query, run, counter, rows, stream)
            roll = env.rng.random()
            if roll < 0.1:
                env.trace(name, f"driver of {q} killed before commit({batch}): replay")
                if env.rng.random() < 0.5:  # it was only paused: it wakes up later and aborts
                    background.add(
                        asyncio.ensure_future(_late(env, functools.partial(abort_batch, c, settings, batch, results)))
                    )
                continue
            if roll < 0.2:
                env.trace(name, f"{q} batch {batch} failed in Spark: abort")
                await abort_batch(c, settings, batch, results)
                continue
            if env.rng.random() < 0.1:  # a speculative attempt of a task, running late
                spec = TaskSpec(batch, query, 0, task_name(run, 1, counter[0] + 1000))
                late = [json.dumps(r).encode() for r in rows[0::2]]  # a copy of partition 0: the same rows
                background.add(
                    asyncio.ensure_future(_late(env, functools.partial(run_task, c, settings, spec, [{stream: late}])))
                )
            outcome = await commit_batch(c, settings, batch, results)
            env.trace(name, f"{q} batch {batch}: {outcome.status}")
            env.record(name, "txn", txn=label, decision="commit", outcome="ok")
            if env.rng.random() < 0.1:
                env.trace(name, f"driver of {q} killed after commit({batch}), before its commit log: replay")
                continue
            checkpoints[q] = batch + 1
        except (OnceflowError, httpx.TransportError) as exc:
            env.trace(name, f"{q} batch {batch} failed: {exc!r}")
            status = exc.status if isinstance(exc, OnceflowError) else None
            if q == "q1" and status is not None and 400 <= status < 500:
                del checkpoints["q1"]  # refused loudly: the user stops the second query
                continue
            await nap(env, 0.1, 0.4)
        await nap(env, 0.05, 0.3)
    for t in background:
        t.cancel()


async def _late(env: Env, work: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    """Something of an old attempt that runs later (a paused driver, a speculative task)."""
    await nap(env, 0.0, 2.0)
    with contextlib.suppress(OnceflowError, httpx.TransportError):
        await work()


async def spark_batch(env: Env, name: str, stream: str) -> None:
    """Batch (non-streaming) write jobs through the sink's real protocol; a job that fails is run
    again, as a user would (a new job: a new sink id)."""
    c = env.client(name)
    await ensure_stream(c, env, stream)
    n = 0
    counter = [0]
    while not env.stopping():
        n += 1
        label = f"{name}/job{n}"
        rows = [f"{label}:{i}" for i in range(env.rng.randint(1, 4))]
        for run in range(3):
            settings = _sink_settings(env, f"batch-{name}-{n}-{run}")
            try:
                env.record(name, "append", id=run, stream=stream, values=rows, txn=label)
                results = await _run_tasks(env, c, settings, None, None, f"{name}-job{n}-{run}", counter, rows, stream)
                await commit_batch(c, settings, None, results)
                env.record(name, "txn", txn=label, decision="commit", outcome="ok")
                break
            except (OnceflowError, httpx.TransportError) as exc:
                status = exc.status if isinstance(exc, OnceflowError) else None
                if status is None or status >= 500 or status == 429:
                    # no answer until the deadline: it may have committed. A job without a batch id
                    # cannot be re-run safely (docs/spark.md: use sinkId and batchId for that)
                    env.record(name, "txn", txn=label, decision="commit", outcome="unknown")
                    env.trace(name, f"{label} run {run}: outcome unknown ({exc!r}); not run again")
                    break
                env.trace(name, f"{label} run {run} failed: {exc!r}; running the job again")
                await nap(env, 0.1, 0.3)
        await nap(env, 0.1, 0.5)


ACTORS: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "idempotent": idempotent_producer,
    "txn": transactional_producer,
    "copier": copier,
    "reader": reader,
    "group": group_member,
    "forker": forker,
    "spark_stream": spark_stream,
    "spark_batch": spark_batch,
}
