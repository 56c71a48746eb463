"""The outbox: side effects recorded in a onceflow stream inside the same transaction as the
consumed offsets, then delivered by a dispatcher with the outbox id as the idempotency key.

::

    source ──SinkRunner(OutboxSink)──▶ outbox stream ──outbox_dispatcher (WebhookSink)──▶ HTTP
            one onceflow transaction:               at-least-once delivery,
            entries + the group's offsets           ``Idempotency-Key: <outbox id>``

Stage 1 is exactly-once by the onceflow transaction (the entries and the offsets commit together;
read_committed readers never see an aborted entry). Stage 2 retries until the receiver answers
2xx and acknowledges only then; the receiver must honour ``Idempotency-Key`` (store the key with
the effect, answer a repeated key without repeating the effect). Together: each side effect once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from .._backoff import backoff
from ..client import Message, OnceflowError, Stream, TransactionalProducer, TransportError
from ..client.lowlevel import ServerURL, error_from_response, http_client, request_url, server_url
from ._api import Checkpoint, CheckpointAwareSink, IdempotentSink, SinkError
from ._runner import SinkRunner

__all__ = ["OutboxSink", "Webhook", "WebhookRejectedError", "WebhookSink", "outbox_dispatcher"]

log = logging.getLogger("onceflow.sinks")


@dataclass(frozen=True, slots=True)
class Webhook:
    """One HTTP request to make, once: ``body`` is sent as JSON."""

    url: str
    body: Any
    method: str = "POST"
    headers: Mapping[str, str] = field(default_factory=dict)


class OutboxSink(CheckpointAwareSink):
    """Stage 1: every message's side effects (``effects(message)``: :class:`Webhook` requests)
    become entries of the JSON stream ``outbox``, written by a
    :class:`~onceflow.client.TransactionalProducer` in one transaction per checkpoint together
    with consumer group ``group``'s offsets.

    An entry is ``{"id", "kind": "webhook", "url", "method", "headers", "body", "source"}``; its id,
    ``<transactional_id>/<stream>/<read offset>/<index>/<n>``, names the input message and the
    effect's place among its effects, so it is unique among committed entries. The sink is atomic:
    the group's offsets are its checkpoint (run it with ``ack=None`` and the same ``group``). A
    restart's ``init`` fences the previous instance and aborts whatever it left open.
    """

    atomic = True

    def __init__(
        self,
        base_url: ServerURL,
        outbox: str,
        *,
        group: str,
        transactional_id: str,
        effects: Callable[[Message], Iterable[Webhook]],
        txn_timeout_ms: int = 60_000,
    ) -> None:
        if not transactional_id:
            raise ValueError("transactional_id must name this writer of the outbox (it fences older instances)")
        self.base_url = server_url(base_url).rstrip("/")
        self.outbox = outbox
        self.group = group
        self.transactional_id = transactional_id
        self.effects = effects
        self.txn_timeout_ms = txn_timeout_ms
        self._producer: TransactionalProducer | None = None

    def _entries(self, msg: Message) -> list[dict[str, Any]]:
        out = []
        for n, hook in enumerate(self.effects(msg)):
            if not isinstance(hook, Webhook):
                raise SinkError(f"effects() must yield Webhook objects, not {type(hook).__name__}")
            out.append(
                {
                    "id": f"{self.transactional_id}/{msg.stream}/{msg.offset}/{msg.index}/{n}",
                    "kind": "webhook",
                    "url": hook.url,
                    "method": hook.method,
                    "headers": dict(hook.headers),
                    "body": hook.body,
                    "source": {"stream": msg.stream, "offset": msg.offset, "index": msg.index},
                }
            )
        return out

    def load_checkpoint(self) -> Checkpoint | None:
        url = f"{request_url(self.base_url)}/v1/groups/{self.group}/offsets"
        try:
            with http_client(self.base_url, timeout=30.0) as client:
                resp = client.get(url)
        except httpx.TransportError as exc:
            raise TransportError(f"load offsets of {self.group}: {exc!r}") from exc
        if resp.status_code != 200:
            raise error_from_response(resp, f"load offsets of {self.group}")
        offsets: dict[str, str] = resp.json()["offsets"]
        return Checkpoint(0, offsets, {}, None, True) if offsets else None

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        if self._producer is not None:
            self._producer.close()
        with Stream.connect(self.base_url, self.outbox) as outbox:
            outbox.create("application/json")  # idempotent; a stream of another type is an error
        self._producer = TransactionalProducer(self.base_url, self.transactional_id, timeout_ms=self.txn_timeout_ms)
        return True

    def _tp(self) -> TransactionalProducer:
        if self._producer is None:
            raise SinkError("OutboxSink used before on_checkpoint_restore (run it with a SinkRunner)")
        return self._producer

    def write(self, messages: Sequence[Message]) -> None:
        entries = [e for m in messages for e in self._entries(m)]
        if entries:
            self._tp().extend(self.outbox, entries)

    def on_checkpoint_prepare(self, checkpoint_id: int) -> None:
        self._tp().flush()  # the entries are on the server, inside the open transaction

    def on_checkpoint_complete(self, checkpoint: Checkpoint) -> None:
        tp = self._tp()
        tp.send_offsets_to_transaction(self.group, checkpoint.offsets)
        tp.commit()

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        if self._producer is not None:
            self._producer.abort()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None


class WebhookRejectedError(SinkError):
    """The receiver refused an outbox entry for good (a 4xx other than 408, 409, 425 and 429)."""

    def __init__(self, message: str, *, status: int, entry_id: str) -> None:
        super().__init__(message)
        self.status = status
        self.entry_id = entry_id


_RETRY_STATUS = frozenset({408, 409, 425, 429})  # 409: the same key is still in flight at the receiver


class WebhookSink(IdempotentSink):
    """Stage 2: delivers outbox entries, each with ``Idempotency-Key: <entry id>``.

    A transport error, a 5xx or a 408/409/425/429 is retried with the same key (backoff from
    ``retry_backoff``, for up to ``delivery_timeout`` seconds per entry, then the checkpoint fails
    and the runner raises); any other 4xx raises :class:`WebhookRejectedError`. Entries go out one
    at a time, in outbox order, at *prepare*: before the dispatcher acknowledges them.
    """

    def __init__(
        self,
        *,
        client: httpx.Client | None = None,
        timeout: float = 10.0,
        retry_backoff: tuple[float, float] = (0.05, 2.0),
        delivery_timeout: float = 60.0,
    ) -> None:
        super().__init__(_entry_id)
        self._own = client is None
        self.client = client or httpx.Client(timeout=timeout)
        self.retry_backoff = retry_backoff
        self.delivery_timeout = delivery_timeout
        self.attempts = 0  # requests sent, retries included

    def write_idempotent(self, records: Sequence[tuple[str, Message]]) -> None:
        for key, msg in records:
            self._deliver(key, msg.value)

    def _deliver(self, key: str, entry: Mapping[str, Any]) -> None:
        headers = {**entry.get("headers", {}), "Idempotency-Key": key}
        deadline = time.monotonic() + self.delivery_timeout
        attempt = 0
        while True:
            self.attempts += 1
            try:
                resp = self.client.request(
                    entry.get("method", "POST"), entry["url"], json=entry.get("body"), headers=headers
                )
                if resp.is_success:
                    return
                if resp.status_code < 500 and resp.status_code not in _RETRY_STATUS:
                    raise WebhookRejectedError(
                        f"outbox entry {key}: {entry['url']} answered {resp.status_code}",
                        status=resp.status_code,
                        entry_id=key,
                    )
                err: Exception = OnceflowError(
                    f"outbox entry {key}: {entry['url']} answered {resp.status_code}",
                    status=resp.status_code,
                    retriable=True,
                )
            except httpx.TransportError as exc:
                err = TransportError(f"outbox entry {key}: {exc!r}")
            if time.monotonic() > deadline:
                raise err
            attempt += 1
            log.debug("retrying outbox entry %s after %r", key, err)
            time.sleep(backoff(attempt, *self.retry_backoff))

    def close(self) -> None:
        if self._own:
            self.client.close()


def _entry_id(msg: Message) -> str:
    value = msg.value
    if not isinstance(value, dict) or value.get("kind") != "webhook" or not isinstance(value.get("id"), str):
        raise SinkError(f"{msg.stream}@{msg.offset}#{msg.index} is not an outbox webhook entry")
    entry_id: str = value["id"]
    return entry_id


def outbox_dispatcher(
    base_url: ServerURL,
    outbox: str,
    *,
    group: str,
    sink: WebhookSink | None = None,
    checkpoint_messages: int = 100,
    checkpoint_interval: float = 0.5,
    live: bool = True,
    **runner: Any,
) -> SinkRunner:
    """The dispatcher for ``outbox``: a :class:`SinkRunner` over a :class:`WebhookSink` that
    acknowledges consumer group ``group`` after each delivered checkpoint."""
    return SinkRunner(
        base_url,
        sink or WebhookSink(),
        job=group,
        streams=[outbox],
        checkpoint_messages=checkpoint_messages,
        checkpoint_interval=checkpoint_interval,
        live=live,
        **runner,
    )
