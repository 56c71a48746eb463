"""The exactly-once sink's protocol between its tasks, its driver and the server, without Spark.

Spark's glue (``spark/writer.py``) reads the task context and Arrow batches and calls these functions
through the client's background loop; a simulator can call them directly on its own event loop
with an ``httpx.AsyncClient`` of its own (any transport). Nothing here imports pyspark or pyarrow:
the inputs are plain values (per target stream, a list of encoded messages). Time is the running
loop's (``loop.time()``, ``asyncio.sleep``) and randomness ``WriterSettings.rng``.

A batch of a sink, in order:

1. each task attempt: :meth:`SinkTask.begin`; :meth:`SinkTask.write` per chunk of its rows;
   :meth:`SinkTask.finish` (or :meth:`SinkTask.abandon` when it fails). Its :class:`TaskResult`
   goes to the driver (Spark: inside the commit message);
2. the driver, once every task finished: :func:`commit_batch` with the results of the attempts it
   uses, or :func:`abort_batch` when the batch failed.

Identity: a sink belongs to one query (``TaskSpec.query``, Spark's query id, stable across restarts
from one checkpoint), bound by its first commit. Tasks and commits of another query are refused
with ``409`` (``sink_owned``); ``POST /v1/sinks/<sink>/reset`` frees the sink on purpose.

Every request is retried on transport errors, 5xx and 429 until ``request_deadline`` and each is
idempotent, so a retry after a lost answer changes nothing: a retried begin (same task name) gets
the same transaction back, a retried commit of the same decision is answered committed. Each
attempt waits at most :func:`attempt_timeout` of the deadline (connect, send, each read), so an
answer lost on a connection that stays open costs a share of the deadline and the retry that
learns the outcome fits in the rest: the driver's commit ends ``committed`` when the batch
committed, and :class:`~onceflow.client.OutcomeUnknownError` (never a plain failure) when no
attempt got an answer within the deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Literal
from urllib.parse import quote

import httpx

from .._backoff import backoff
from ..client import OnceflowError, OutcomeUnknownError, TransportError
from ..client.lowlevel import Coding, error_from_response, request_url, stream_url
from ..client.transactions import AsyncTransactionalProducer

__all__ = [
    "BatchOutcome",
    "Fingerprint",
    "SinkTask",
    "TaskResult",
    "TaskSpec",
    "WriterSettings",
    "abort_batch",
    "attempt_timeout",
    "commit_batch",
    "run_task",
    "task_name",
]

log = logging.getLogger("onceflow.spark")

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the request cannot have reached the server


def attempt_timeout(deadline: float) -> float:
    """Seconds one attempt of a request may wait (to connect, send, and for each read of the
    answer) under a retry deadline of ``deadline`` seconds (``requestTimeoutSeconds``): a quarter
    of it, at most 30 s. So an answer lost on a connection that stays open costs a quarter of the
    deadline, and the retries that learn what became of the request fit in the rest."""
    return min(30.0, deadline / 4)


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """What a sink's tasks and driver need to know (from the connector's options)."""

    url: str
    sink: str  # the sink id (``sinkId``), or the id of one batch write job
    content_type: str = "application/json"  # of the streams the sink creates
    transaction_timeout_ms: int = (
        300_000  # a task's transaction left open longer, with no task of its batch at work, is aborted
    )
    request_deadline: float = 120.0  # seconds a request is retried (transport errors, 5xx, 429)
    verify_replay: bool = True  # compare a replayed batch's rows with the committed ones (Fingerprint)
    max_batch_bytes: int = 1 << 20
    retry_backoff: tuple[float, float] = (0.05, 2.0)
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)  # jitter of retries
    compression: Coding | None = None  # the coding of the tasks' appends (option compression)

    @property
    def attempt_timeout(self) -> float:
        """What one attempt of a request waits at most: :func:`attempt_timeout` of the deadline."""
        return attempt_timeout(self.request_deadline)

    @property
    def prefix(self) -> str:
        """The transactional ids of the sink's tasks all start with this."""
        return f"spark/{self.sink}/"

    def path(self, action: str = "") -> str:
        return f"{request_url(self.url)}/v1/sinks/{quote(self.sink, safe='')}" + (f"/{action}" if action else "")


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task attempt's part of a batch."""

    batch: int | None  # the batch id (None: a batch write without batch id)
    query: str | None  # the query the batch belongs to (None: not a streaming query's)
    partition: int
    task: str  # names this task attempt, unique among all attempts ever (see :func:`task_name`)


def task_name(run: str, attempt_number: int, task_attempt_id: int) -> str:
    """The name of a Spark task attempt: the write job's random ``run`` id and Spark's task
    attempt id, which is unique within a SparkContext. Not ``attempt_number``: attempts of a
    retried stage count from 0 again while the first stage attempt's may still run."""
    return f"{run}/t{task_attempt_id}a{attempt_number}"


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Rows handed to a batch's tasks: their number and a checksum that neither their order nor
    their split among tasks changes (a sum of CRC-32s of ``stream NUL value``). It catches a
    replay planned over other input; it is no cryptographic proof."""

    rows: int = 0
    checksum: int = 0

    def add(self, stream: str, values: Iterable[bytes]) -> Fingerprint:
        head = zlib.crc32(stream.encode() + b"\0")
        values = values if isinstance(values, Sequence) else list(values)
        total = self.checksum + sum(map(zlib.crc32, values, repeat(head)))  # no bytecode per row
        return Fingerprint(self.rows + len(values), total & 0xFFFF_FFFF_FFFF_FFFF)

    def __add__(self, other: Fingerprint) -> Fingerprint:
        return Fingerprint(self.rows + other.rows, (self.checksum + other.checksum) & 0xFFFF_FFFF_FFFF_FFFF)

    def token(self) -> str:
        return f"{self.rows}-{self.checksum:016x}"


@dataclass(frozen=True, slots=True)
class TaskResult:
    """What one task attempt reports to the driver (Spark's commit message carries it)."""

    sink: str
    batch: int | None
    query: str | None
    partition: int
    transactional_id: str  # "" when skipped
    epoch: int
    txn: int | None  # the transaction it leaves open for the driver (0: it wrote nothing); None when skipped
    rows: int  # rows written
    skipped: bool  # the batch was already committed: the task wrote nothing
    fingerprint: Fingerprint | None = None  # of the rows it was given (None: not computed)

    def member(self) -> dict[str, Any] | None:
        """The task's transaction as a member of the batch's commit (None when skipped)."""
        if self.txn is None:
            return None
        return {"id": self.transactional_id, "epoch": self.epoch, "txn": self.txn}


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    status: Literal["committed", "already_committed", "empty"]
    batch: int | None  # the sink's last committed batch after the request


async def _request(
    client: httpx.AsyncClient,
    settings: WriterSettings,
    method: str,
    url: str,
    what: str,
    *,
    unknown: str | None = None,
    **kw: Any,
) -> httpx.Response:
    """One request, retried on transport errors, 5xx and 429 until ``request_deadline`` (every
    request here is idempotent); any other status but 200 is raised.

    Each attempt waits at most ``settings.attempt_timeout``, and no longer than the deadline
    leaves (but at least a quarter of that), so the deadline bounds the whole request: a lost
    answer on a connection that stays open is retried, not waited out. ``unknown``: what the
    caller can look at to learn the outcome, when no attempt got an answer within the deadline
    and one may have reached the server; :class:`OutcomeUnknownError` is then raised, not the last
    transport error (the request may have done its work)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + settings.request_deadline
    most = settings.attempt_timeout
    attempt = 0
    reached = False  # an attempt may have reached the server
    while True:
        try:
            timeout = max(min(most, give_up - loop.time()), most / 4)
            resp = await client.request(method, url, timeout=timeout, **kw)
            if resp.status_code in (200, 201):
                return resp
            err: OnceflowError = error_from_response(resp, what)
            if resp.status_code < 500 and resp.status_code != 429:
                raise err
            reached = True
        except httpx.TransportError as exc:
            err = TransportError(f"{what}: {exc!r} (is the onceflow server at {settings.url} running?)")
            reached = reached or not isinstance(exc, _NOT_SENT)
        if loop.time() >= give_up:
            if unknown is not None and reached:
                raise OutcomeUnknownError(
                    f"{what}: no answer within requestTimeoutSeconds ({settings.request_deadline:g} s; last: "
                    f"{err.message}); it may or may not have been done: {unknown}",
                    status=err.status,
                    code="outcome_unknown",
                )
            raise err
        attempt += 1
        pause = backoff(attempt, *settings.retry_backoff, rng=settings.rng)
        await asyncio.sleep(min(pause, max(0.0, give_up - loop.time())))  # a last attempt at the deadline


async def _ensure_stream(client: httpx.AsyncClient, settings: WriterSettings, stream: str) -> None:
    """Create ``stream`` with the sink's content type if it is missing (a PUT is idempotent)."""
    url = request_url(stream_url(settings.url, stream))
    try:
        await _request(client, settings, "HEAD", url, f"head {stream}")
    except OnceflowError as exc:
        if exc.status != 404:
            raise
        await _request(
            client, settings, "PUT", url, f"create {stream}", headers={"content-type": settings.content_type}
        )


class SinkTask:
    """One task attempt writing its part of a batch: :meth:`begin`, :meth:`write`..., :meth:`finish`."""

    def __init__(self, client: httpx.AsyncClient, settings: WriterSettings, spec: TaskSpec) -> None:
        self.client = client
        self.settings = settings
        self.spec = spec
        self.skipped = False
        self.verify = False  # skipped, but the rows' fingerprint is still wanted
        self.transactional_id = ""
        self.epoch = -1
        self.rows = 0
        self._begun_txn = 0
        self._fingerprint: Fingerprint | None = Fingerprint() if settings.verify_replay else None
        self._producer: AsyncTransactionalProducer | None = None
        self._streams: set[str] = set()  # target streams known to exist
        self._heartbeat: asyncio.Task[None] | None = None
        self._stopped = False  # abandon() was called: the keep-alive ends even if a cancel is lost

    @property
    def reads_input(self) -> bool:
        """Whether :meth:`write` needs the task's rows (a skipped task whose fingerprint nobody
        checks does not: its input need not even be computed)."""
        return not self.skipped or self.verify

    def _body(self) -> dict[str, Any]:
        return {"query": self.spec.query, "batch": self.spec.batch}

    @classmethod
    async def begin(cls, client: httpx.AsyncClient, settings: WriterSettings, spec: TaskSpec) -> SinkTask:
        """Start the task: ``POST /v1/sinks/<sink>/begin``.

        - The sink belongs to another query: raises (409, ``sink_owned``; the message says which
          query owns it, its last batch and how to reset it).
        - The sink already committed this batch (a replay): the task is ``skipped`` and writes
          nothing. When the server holds a fingerprint of this very batch, :meth:`write` still
          takes the rows to compute theirs (``verify``), for the driver's commit to compare.
        - Otherwise the server hands out the task's transactional id (``spark/<sink>/p<n>/s<slot>``)
          with a fresh epoch, fencing the id's previous holder, and registers the task with the
          batch: the batch's commit or abort fences every registered task that is not among its
          members, so a late or speculative attempt cannot open a transaction after its batch
          was decided. While the task runs, it tells the server every quarter of the transaction
          timeout that its batch is at work (``/alive``), so the transactions of the batch's
          finished tasks are not aborted while its slowest task still runs.

        Idempotent: a retry after a lost answer (same ``spec.task``) gets the same id and epoch."""
        task = cls(client, settings, spec)
        body = {
            **task._body(),
            "partition": spec.partition,
            "task": spec.task,
            "timeout_ms": settings.transaction_timeout_ms,
        }
        answer = (
            await _request(
                client,
                settings,
                "POST",
                settings.path("begin"),
                f"begin a task of batch {spec.batch} of sink {settings.sink}",
                json=body,
            )
        ).json()
        if answer["status"] == "already_committed":
            task.skipped = True
            task.verify = bool(answer.get("verify")) and settings.verify_replay
            return task
        task.transactional_id, task.epoch, task._begun_txn = answer["id"], answer["epoch"], answer["txn"]
        producer = AsyncTransactionalProducer(
            settings.url,
            task.transactional_id,
            timeout_ms=settings.transaction_timeout_ms,
            max_batch_bytes=settings.max_batch_bytes,
            retry_backoff=settings.retry_backoff,
            delivery_timeout=settings.request_deadline,
            client=client,
            compression=settings.compression,
        )
        producer.resume(answer["producer_id"], answer["epoch"], answer["txn"])
        task._producer = producer
        task._heartbeat = asyncio.ensure_future(task._keep_alive())
        return task

    async def _keep_alive(self) -> None:
        interval = max(0.05, self.settings.transaction_timeout_ms / 4000)
        while not self._stopped:
            await asyncio.sleep(interval)
            if self._stopped:
                return
            try:
                resp = await self.client.post(self.settings.path("alive"), json=self._body())
                if resp.status_code != 200:
                    log.warning("onceflow sink %s: keep-alive answered %d", self.settings.sink, resp.status_code)
            except httpx.HTTPError as exc:  # the next one may get through; the timeout is 4 intervals
                log.warning("onceflow sink %s: keep-alive failed: %r", self.settings.sink, exc)

    async def write(self, rows: Mapping[str, Sequence[bytes]]) -> None:
        """Add rows, per target stream, to the task's open transaction (missing streams are
        created first). Buffered; sent in requests of up to ``max_batch_bytes``. A skipped task
        only adds them to its fingerprint."""
        for stream, values in rows.items():
            if not values:
                continue
            if self._fingerprint is not None:
                self._fingerprint = self._fingerprint.add(stream, values)
            if self.skipped:
                continue
            assert self._producer is not None
            if stream not in self._streams:
                await _ensure_stream(self.client, self.settings, stream)
                self._streams.add(stream)
            await self._producer.extend(stream, values)
            self.rows += len(values)

    async def finish(self) -> TaskResult:
        """Send what is buffered and report the transaction, left open for the driver."""
        txn: int | None = None
        try:
            if self._producer is not None:
                await self._producer.flush()
                txn = self._producer.txn if self._producer.txn is not None else self._begun_txn
        finally:
            await self.abandon()
        s = self.spec
        fingerprint = self._fingerprint if not self.skipped or self.verify else None
        return TaskResult(
            self.settings.sink,
            s.batch,
            s.query,
            s.partition,
            self.transactional_id,
            self.epoch,
            txn,
            self.rows,
            self.skipped,
            fingerprint,
        )

    async def abandon(self) -> None:
        """Stop (the task failed, or finished): no more keep-alives. An open transaction is left
        to the driver's commit or abort, the sink's next commit, or the timeout."""
        self._stopped = True  # a cancel swallowed on its way (asyncio.wait_for may lose one) ends it too
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.cancel()
            # asyncio.wait: the keep-alive's own CancelledError stays in it, while a cancel of
            # abandon() itself still goes up (suppressing CancelledError here would swallow both)
            await asyncio.wait({heartbeat})
        if self._producer is not None:
            await self._producer.close()


async def run_task(
    client: httpx.AsyncClient,
    settings: WriterSettings,
    spec: TaskSpec,
    chunks: Iterable[Mapping[str, Sequence[bytes]]],
) -> TaskResult:
    """A whole task: :meth:`SinkTask.begin`, one :meth:`SinkTask.write` per chunk (none when its
    input is not needed), :meth:`SinkTask.finish`; :meth:`SinkTask.abandon` when one raises."""
    task = await SinkTask.begin(client, settings, spec)
    try:
        if task.reads_input:
            for chunk in chunks:
                await task.write(chunk)
        return await task.finish()
    except BaseException:
        await task.abandon()
        raise


def _query(results: Sequence[TaskResult | None]) -> str | None:
    queries = {r.query for r in results if r is not None}
    if len(queries) > 1:
        raise OnceflowError(f"the tasks of one batch name different queries: {sorted(map(str, queries))}")
    return queries.pop() if queries else None


async def commit_batch(
    client: httpx.AsyncClient,
    settings: WriterSettings,
    batch: int | None,
    results: Sequence[TaskResult | None],
) -> BatchOutcome:
    """Commit the batch: every task's transaction as one decision that records ``batch`` as the
    sink's last (``POST /v1/sinks/<sink>/commit``), once every task finished.

    - ``committed``: the rows of all tasks became visible at once. The other tasks registered
      for the batch (failed, late or speculative attempts) are fenced, and leftovers under
      ``spark/<sink>/`` aborted.
    - ``already_committed``: a replay of a batch the sink committed; nothing was added and the
      results' transactions were aborted. Raises (409, ``replay_mismatch``) instead when it is the
      sink's last batch and the results' fingerprint differs from the committed one.
    - raises 409 ``sink_owned`` for a query the sink does not belong to, 403/409 when a member was
      fenced or ended (nothing of the batch is then visible).
    - raises :class:`~onceflow.client.OutcomeUnknownError` when no attempt got an answer within
      ``request_deadline`` (the batch may or may not have committed; the message says where to look).
    - ``empty``: no task ran; nothing is sent.

    A retry after a lost answer is the same decision: answered ``committed``. So an answer lost
    on the way (a reset, or held on an open connection: each attempt waits at most
    ``settings.attempt_timeout``) is resolved by the retry within the deadline, and the caller
    is told ``committed``, not a transport error, for a batch that committed."""
    if not results:
        return BatchOutcome("empty", None)
    body: dict[str, Any] = {
        "members": _members(results),
        "abort_prefix": settings.prefix,
        "query": _query(results),
        "rows": sum(r.rows for r in results if r is not None and not r.skipped),  # shown with the sink
    }
    if batch is not None:
        body["batch"] = batch
        prints = [r.fingerprint for r in results if r is not None]
        if settings.verify_replay and len(prints) == len(results) and all(p is not None for p in prints):
            total = Fingerprint()
            for p in prints:
                assert p is not None
                total = total + p
            body["fingerprint"] = total.token()
    resp = await _request(
        client,
        settings,
        "POST",
        settings.path("commit"),
        f"commit batch {batch} of sink {settings.sink}",
        unknown=(f"GET {settings.path()} shows the sink's last committed batch and its rows (null: nothing committed)"),
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    answer = resp.json()
    return BatchOutcome(answer["status"], answer.get("batch"))


async def abort_batch(
    client: httpx.AsyncClient,
    settings: WriterSettings,
    batch: int | None,
    results: Sequence[TaskResult | None],
) -> None:
    """Abort the batch (``POST /v1/sinks/<sink>/abort``): the results' transactions, every other
    task the query registered for it (fenced), and, when the sink is the query's own, the
    leftovers under ``spark/<sink>/``. A query the sink does not belong to aborts only its own
    tasks. Idempotent."""
    body: dict[str, Any] = {"members": _members(results), "abort_prefix": settings.prefix, "query": _query(results)}
    if batch is not None:
        body["batch"] = batch
    await _request(
        client,
        settings,
        "POST",
        settings.path("abort"),
        f"abort batch {batch} of sink {settings.sink}",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )


def _members(results: Sequence[TaskResult | None]) -> list[dict[str, Any]]:
    return [m for m in (r.member() for r in results if r is not None) if m is not None]
