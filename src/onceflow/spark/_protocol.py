"""The exactly-once sink's protocol between its tasks, its driver and the server, without Spark.

Spark's glue (``spark/sink.py``) reads task context and Arrow batches and calls these functions
through the client's background loop; a simulator can call them directly on its own event loop
with an ``httpx.AsyncClient`` of its own (any transport). Nothing here imports pyspark or pyarrow:
the inputs are plain values (per target stream, a list of encoded messages).

A batch of a sink, in order:

1. each task: :meth:`SinkTask.begin`, :meth:`SinkTask.write` per chunk of rows,
   :meth:`SinkTask.finish` (or :meth:`SinkTask.abandon` when it fails); its :class:`TaskResult`
   goes to the driver;
2. the driver: :func:`commit_batch` with every task's result, or :func:`abort_batch`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import httpx

from ..client._errors import OnceflowError, TransportError, error_from_response
from ..client._protocol import stream_url
from ..client.transactions import AsyncTransactionalProducer

__all__ = [
    "BatchOutcome",
    "SinkTask",
    "TaskResult",
    "TaskSpec",
    "WriterSettings",
    "abort_batch",
    "commit_batch",
    "run_task",
    "task_name",
]

log = logging.getLogger("onceflow.spark")


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """What a sink's tasks and driver need to know (from the connector's options)."""

    url: str
    sink: str  # the sink id (``sinkId``), or the id of one batch write job
    content_type: str = "application/json"  # of the streams the sink creates
    transaction_timeout_ms: int = 300_000
    request_deadline: float = 120.0  # seconds a request is retried (transport errors, 5xx, 429)
    max_batch_bytes: int = 1 << 20
    retry_backoff: tuple[float, float] = (0.05, 2.0)
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)  # jitter of retries

    @property
    def prefix(self) -> str:
        """The transactional ids of the sink's tasks all start with this."""
        return f"spark/{self.sink}/"

    def path(self, action: str = "") -> str:
        return f"{self.url}/v1/sinks/{quote(self.sink, safe='')}" + (f"/{action}" if action else "")


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task attempt's part of a batch."""

    batch: int | None  # the batch id (None: a batch write without batch id)
    query: str | None  # the query the batch belongs to (None: not a streaming query's)
    partition: int
    task: str  # names this task attempt (see :func:`task_name`)


def task_name(run: str, attempt_number: int, task_attempt_id: int) -> str:
    """The name of a Spark task attempt, from the write job's ``run`` id and Spark's numbers."""
    del run, task_attempt_id
    return f"a{attempt_number}"


@dataclass(frozen=True, slots=True)
class TaskResult:
    """What one task reports to the driver (Spark's commit message carries it)."""

    sink: str
    batch: int | None
    query: str | None
    partition: int
    transactional_id: str
    epoch: int
    txn: int | None  # the open transaction it leaves for the driver; None when it wrote nothing
    rows: int
    skipped: bool  # the batch was already committed: the task wrote nothing

    def member(self) -> dict[str, Any] | None:
        if self.txn is None:
            return None
        return {"id": self.transactional_id, "epoch": self.epoch, "txn": self.txn}


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    status: Literal["committed", "already_committed", "empty"]
    batch: int | None  # the sink's last committed batch after the request


async def _request(client: httpx.AsyncClient, settings: WriterSettings, method: str, url: str, what: str, **kw: Any) -> httpx.Response:
    """One request, retried on transport errors, 5xx and 429 until ``request_deadline`` (every
    request here is idempotent); any other status but 200 is raised."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + settings.request_deadline
    attempt = 0
    while True:
        try:
            resp = await client.request(method, url, **kw)
            if resp.status_code in (200, 201):
                return resp
            err: OnceflowError = error_from_response(resp, what)
            if resp.status_code < 500 and resp.status_code != 429:
                raise err
        except httpx.TransportError as exc:
            err = TransportError(f"{what}: {exc!r} (is the onceflow server at {settings.url} running?)")
        if loop.time() > give_up:
            raise err
        attempt += 1
        low, high = settings.retry_backoff
        await asyncio.sleep(min(high, low * 2 ** min(attempt, 8)) * (0.8 + 0.4 * settings.rng.random()))


async def _ensure_stream(client: httpx.AsyncClient, settings: WriterSettings, stream: str) -> None:
    """Create ``stream`` with the sink's content type if it is missing (a PUT is idempotent)."""
    url = stream_url(settings.url, stream)
    try:
        await _request(client, settings, "HEAD", url, f"head {stream}")
    except OnceflowError as exc:
        if exc.status != 404:
            raise
        await _request(client, settings, "PUT", url, f"create {stream}", headers={"content-type": settings.content_type})


class SinkTask:
    """One task attempt writing its part of a batch: :meth:`begin`, :meth:`write`..., :meth:`finish`."""

    def __init__(self, client: httpx.AsyncClient, settings: WriterSettings, spec: TaskSpec) -> None:
        self.client = client
        self.settings = settings
        self.spec = spec
        self.skipped = False
        self.transactional_id = f"{settings.prefix}p{spec.partition}/{spec.task}"
        self.rows = 0
        self._producer: AsyncTransactionalProducer | None = None
        self._streams: set[str] = set()  # target streams known to exist

    @property
    def reads_input(self) -> bool:
        """Whether :meth:`write` needs the task's rows (a skipped task does not)."""
        return not self.skipped

    @classmethod
    async def begin(cls, client: httpx.AsyncClient, settings: WriterSettings, spec: TaskSpec) -> SinkTask:
        """Start the task: a batch the sink already committed is skipped (nothing is written);
        otherwise the task's transactional id is initialised, which fences an earlier holder."""
        task = cls(client, settings, spec)
        if spec.batch is not None:
            body = (await _request(client, settings, "GET", settings.path(), f"progress of sink {settings.sink}")).json()
            done = body.get("batch")
            if done is not None and spec.batch <= int(done):
                task.skipped = True
                return task
        producer = AsyncTransactionalProducer(
            settings.url, task.transactional_id, timeout_ms=settings.transaction_timeout_ms, max_batch_bytes=settings.max_batch_bytes,
            retry_backoff=settings.retry_backoff, delivery_timeout=settings.request_deadline, client=client,
        )
        await producer.init()
        task._producer = producer
        return task

    async def write(self, rows: Mapping[str, Sequence[bytes]]) -> None:
        """Add rows, per target stream, to the task's open transaction (created streams are
        created first). Buffered; sent in requests of up to ``max_batch_bytes``."""
        if self.skipped:
            return
        assert self._producer is not None
        for stream, values in rows.items():
            if not values:
                continue
            if stream not in self._streams:
                await _ensure_stream(self.client, self.settings, stream)
                self._streams.add(stream)
            await self._producer.extend(stream, values)
            self.rows += len(values)

    async def finish(self) -> TaskResult:
        """Send what is buffered and report the open transaction (left open for the driver)."""
        txn: int | None = None
        epoch = -1
        if self._producer is not None:
            await self._producer.flush()
            txn, epoch = self._producer.txn, self._producer.epoch
            await self._producer.close()
        s = self.spec
        return TaskResult(self.settings.sink, s.batch, s.query, s.partition, self.transactional_id, epoch, txn, self.rows, self.skipped)

    async def abandon(self) -> None:
        """The task failed: stop. Its open transaction is left to the driver's abort, the next
        commit of the sink, or the timeout."""
        if self._producer is not None:
            await self._producer.close()


async def run_task(
    client: httpx.AsyncClient, settings: WriterSettings, spec: TaskSpec, chunks: Iterable[Mapping[str, Sequence[bytes]]],
) -> TaskResult:
    """A whole task: :meth:`SinkTask.begin`, one :meth:`SinkTask.write` per chunk, :meth:`SinkTask.finish`."""
    task = await SinkTask.begin(client, settings, spec)
    try:
        if task.reads_input:
            for chunk in chunks:
                await task.write(chunk)
        return await task.finish()
    except BaseException:
        await task.abandon()
        raise


def _members(results: Sequence[TaskResult | None]) -> list[dict[str, Any]]:
    return [m for m in (r.member() for r in results if r is not None) if m is not None]


async def commit_batch(
    client: httpx.AsyncClient, settings: WriterSettings, batch: int | None, results: Sequence[TaskResult | None],
) -> BatchOutcome:
    """Commit every task's transaction as one decision that records ``batch`` (the driver)."""
    body: dict[str, Any] = {"members": _members(results), "abort_prefix": settings.prefix}
    if batch is not None:
        body["batch"] = batch
    resp = await _request(
        client, settings, "POST", settings.path("commit"), f"commit batch {batch} of sink {settings.sink}",
        content=json.dumps(body), headers={"content-type": "application/json"},
    )
    answer = resp.json()
    return BatchOutcome(answer["status"], answer.get("batch"))


async def abort_batch(
    client: httpx.AsyncClient, settings: WriterSettings, batch: int | None, results: Sequence[TaskResult | None],
) -> None:
    """Abort every task's transaction of the batch and the sink's leftovers (the driver)."""
    body: dict[str, Any] = {"members": _members(results), "abort_prefix": settings.prefix}
    await _request(
        client, settings, "POST", settings.path("abort"), f"abort batch {batch} of sink {settings.sink}",
        content=json.dumps(body), headers={"content-type": "application/json"},
    )
