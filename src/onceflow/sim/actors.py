"""The clients of a simulation: real onceflow client code on the simulated network.

Each actor records what it does and what it was told in the history format of
:mod:`onceflow.chaos.history`, so one checker judges chaos runs and simulations alike. Values are
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
import json
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from ..chaos.worker import parse_records
from ..client._errors import OnceflowError
from ..client.producer import AsyncIdempotentProducer
from ..client.transactions import AsyncTransactionalProducer

__all__ = ["ACTORS", "Env"]

URL = "http://onceflow.sim"
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
            URL, stream, producer_id=name, epoch=epoch, content_type="application/json", client=c,
            delivery_timeout=env.rng.uniform(2.0, 6.0), max_in_flight=env.rng.randint(1, 3),
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
    (``spurious-fence``)."""
    c = env.client(name)
    for s in streams:
        await ensure_stream(c, env, s)
    k = 0
    while not env.stopping():
        producer = AsyncTransactionalProducer(
            URL, name, client=c, timeout_ms=int(env.txn_timeout * 1000), delivery_timeout=env.rng.uniform(1.0, 4.0),
            retry_backoff=(0.02, 0.3),
        )
        try:
            await producer.init()
        except OnceflowError as exc:
            env.trace(name, f"init failed: {exc}")
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
                            if first and quick and clean == env.crashes() and (exc.status == 403 or exc.code == "transaction_aborted"):
                                env.anomaly("spurious-fence", stream, f"{name}: fenced on the first append of {label}, "
                                            f"though its last transaction was confirmed ended and the server did not "
                                            f"restart since: {exc}")
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
            URL, name, client=c, timeout_ms=int(env.txn_timeout * 1000), delivery_timeout=env.rng.uniform(1.0, 4.0),
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
                    env.record(name, "read", stream=s, isolation="read_committed", start=positions[s], next=nxt, records=records)
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
            headers["stream-fork-offset"] = head.headers.get("stream-last-stable-offset", head.headers["stream-next-offset"])
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


@dataclass
class _Task:
    tid: str
    epoch: int
    txn: int | None


async def _sink_progress(c: httpx.AsyncClient, sink: str) -> int | None:
    r = await c.get(f"{URL}/v1/sinks/{quote(sink, safe='')}")
    if r.status_code != 200:
        raise OnceflowError(f"progress of {sink}: {r.status_code}", status=r.status_code)
    done = r.json().get("batch")
    return int(done) if done is not None else None


async def _spark_task(env: Env, c: httpx.AsyncClient, prefix: str, sink: str, batch: int | None,
                      partition: int, attempt: int, rows: list[str], stream: str) -> _Task | None:
    """What a task of the onceflow sink does: skip a committed batch, else write its rows in its own
    transaction and leave it open for the driver (spark/sink.py ``_write_task``)."""
    tid = f"{prefix}p{partition}/a{attempt}"
    if batch is not None:
        done = await _sink_progress(c, sink)
        if done is not None and batch <= done:
            return None
    producer = AsyncTransactionalProducer(URL, tid, client=c, timeout_ms=int(env.txn_timeout * 1000),
                                          delivery_timeout=env.rng.uniform(1.0, 3.0), retry_backoff=(0.02, 0.3))
    try:
        await producer.init()
        if rows:
            await producer.extend(stream, rows)
            await producer.flush()
        return _Task(tid, producer.epoch, producer.txn)
    finally:
        await producer.close()


def _members(tasks: list[_Task]) -> list[dict[str, Any]]:
    return [{"id": t.tid, "epoch": t.epoch, "txn": t.txn} for t in tasks if t.txn is not None]


async def _sink_request(c: httpx.AsyncClient, sink: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/sinks/<sink>/<action>, retried on transport errors and 5xx (spark/_http.py Conn.request)."""
    for _ in range(8):
        try:
            r = await c.post(f"{URL}/v1/sinks/{quote(sink, safe='')}/{action}", json=body)
        except httpx.TransportError:
            await asyncio.sleep(0.1)
            continue
        if r.status_code >= 500:
            await asyncio.sleep(0.1)
            continue
        if r.status_code != 200:
            raise OnceflowError(f"{action} of sink {sink}: {r.status_code} {r.text[:160]}", status=r.status_code)
        result: dict[str, Any] = r.json()
        return result
    raise OnceflowError(f"{action} of sink {sink}: no answer")


async def _run_batch(env: Env, c: httpx.AsyncClient, name: str, sink: str, prefix: str, batch: int | None,
                     attempt: int, rows: list[str], stream: str, label: str) -> list[_Task]:
    env.record(name, "append", id=attempt, stream=stream, values=rows, txn=label)
    tasks = []
    for p in range(2):
        t = await _spark_task(env, c, prefix, sink, batch, p, attempt, rows[p::2], stream)
        if t is not None:
            tasks.append(t)
    return tasks


async def spark_stream(env: Env, name: str, sink: str, stream: str) -> None:
    """A streaming query whose driver is killed now and then (the batch is replayed from the
    checkpoint, before or after the sink's commit), whose batches sometimes fail (Spark's
    ``abort``), and sometimes a paused old driver wakes up and aborts the batch it had been
    writing. With some seeds a second checkpoint of the same sink id starts from batch 0 again,
    a user's mistake that the sink must refuse loudly, never answer by skipping rows."""
    c = env.client(name)
    await ensure_stream(c, env, stream)
    prefix = f"spark/{sink}/"
    checkpoints = {"q0": 0}
    if env.rng.random() < 0.4:
        checkpoints["q1"] = 0
    attempt = 0
    planned: dict[str, list[str]] = {}
    zombies: set[asyncio.Task[None]] = set()
    while not env.stopping():
        q = "q1" if "q1" in checkpoints and env.rng.random() < 0.3 else "q0"
        batch = checkpoints[q]
        label = f"{name}/{q}/b{batch}"
        rows = planned.setdefault(label, [f"{label}:{i}" for i in range(env.rng.randint(1, 4))])  # a replay: the same rows
        attempt += 1
        try:
            tasks = await _run_batch(env, c, name, sink, prefix, batch, attempt, rows, stream, label)
            roll = env.rng.random()
            if roll < 0.1:
                env.trace(name, f"driver of {q} killed before commit({batch}): replay")
                if env.rng.random() < 0.5:
                    zombies.add(asyncio.ensure_future(_zombie_abort(env, c, sink, prefix, tasks)))
                continue
            if roll < 0.2:
                env.trace(name, f"{q} batch {batch} failed in Spark: abort")
                await _sink_request(c, sink, "abort", {"members": _members(tasks), "abort_prefix": prefix})
                continue
            result = await _sink_request(c, sink, "commit", {"batch": batch, "members": _members(tasks), "abort_prefix": prefix})
            env.trace(name, f"{q} batch {batch}: {result.get('status')}")
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
    for z in zombies:
        z.cancel()


async def _zombie_abort(env: Env, c: httpx.AsyncClient, sink: str, prefix: str, tasks: list[_Task]) -> None:
    """A driver that was paused (not dead) wakes up and aborts the batch it was writing."""
    await nap(env, 0.0, 2.0)
    with contextlib.suppress(OnceflowError, httpx.TransportError):
        await _sink_request(c, sink, "abort", {"members": _members(tasks), "abort_prefix": prefix})


async def spark_batch(env: Env, name: str, stream: str) -> None:
    """Batch (non-streaming) write jobs; a job that fails is run again, as a user would."""
    c = env.client(name)
    await ensure_stream(c, env, stream)
    n = 0
    while not env.stopping():
        n += 1
        label = f"{name}/job{n}"
        rows = [f"{label}:{i}" for i in range(env.rng.randint(1, 4))]
        for run in range(3):
            job = f"batch-{name}-{n}-{run}"
            prefix = f"spark-batch/{job}/"
            try:
                tasks = await _run_batch(env, c, name, job, prefix, None, run, rows, stream, label)
                await _sink_request(c, job, "commit", {"members": _members(tasks), "abort_prefix": prefix})
                env.record(name, "txn", txn=label, decision="commit", outcome="ok")
                break
            except (OnceflowError, httpx.TransportError) as exc:
                env.trace(name, f"{label} run {run} failed: {exc!r}; running the job again")
                await nap(env, 0.1, 0.3)
        await nap(env, 0.1, 0.5)


ACTORS: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "idempotent": idempotent_producer,
    "txn": transactional_producer,
    "copier": copier,
    "reader": reader,
    "forker": forker,
    "spark_stream": spark_stream,
    "spark_batch": spark_batch,
}
