"""Transactional producers: writes to many streams plus consumer offsets, committed as one.

::

    with TransactionalProducer(url, "copier-1") as producer:      # init: fences older instances
        with producer.transaction():                             # commit on success, abort on error
            producer.append("out/0", {"n": 1})
            producer.append("out/1", {"n": 2})
            producer.send_offsets_to_transaction("copy", consumer.positions())

Appends are buffered per stream and sent (one POST per stream and up to ``max_batch_bytes``) when
the buffer fills, on ``flush()`` and with the commit, which rides on the last POST. Each POST is idempotent (``txn:<id>``,
epoch, a per-stream sequence), so retries after timeouts or 5xx never duplicate. A 403 means a newer
instance of the same transactional id took over: this one is fenced for good (make a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import httpx

from ._errors import OnceflowError, TransportError, error_from_response
from ._loop import background_loop, run_sync
from ._protocol import auth_headers, is_json_type, stream_url, tls_verify

__all__ = ["AsyncTransactionalProducer", "GroupOffsetStore", "TransactionalProducer"]


class AsyncTransactionalProducer:
    """A transactional producer for one transactional id, on the running event loop."""

    def __init__(
        self,
        base_url: str,
        transactional_id: str,
        *,
        timeout_ms: int = 60_000,
        max_batch_bytes: int = 1 << 20,
        retry_backoff: tuple[float, float] = (0.05, 2.0),
        delivery_timeout: float = 60.0,
        client: httpx.AsyncClient | None = None,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.transactional_id = transactional_id
        self.timeout_ms = timeout_ms
        self.max_batch_bytes = max_batch_bytes
        self.retry_backoff = retry_backoff
        self.delivery_timeout = delivery_timeout
        self._own = client is None
        self._client = client or httpx.AsyncClient(timeout=30.0, verify=tls_verify(self.base_url), headers=auth_headers(token))
        self.producer_id = ""
        self.epoch = -1
        self.txn: int | None = None  # the server's number of the open transaction, once known
        self._ended = 0  # the number of the last transaction this instance ended (0 after init)
        self._seqs: dict[str, int] = {}
        self._buffers: dict[str, list[bytes]] = {}
        self._buffer_bytes: dict[str, int] = {}
        self._types: dict[str, str] = {}
        self._fenced: OnceflowError | None = None

    def _url(self, path: str) -> str:
        return f"{self.base_url}/v1/txn/{self.transactional_id}/{path}"

    async def _post_json(self, url: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        resp = await self._request("POST", url, what, json=body)
        if resp.status_code != 200:
            raise self._note(error_from_response(resp, what))
        result: dict[str, Any] = resp.json()
        return result

    async def _request(self, method: str, url: str, what: str, **kw: Any) -> httpx.Response:
        """One request, retried on transport errors and 5xx (every request here is idempotent)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.delivery_timeout
        attempt = 0
        while True:
            try:
                resp = await self._client.request(method, url, **kw)
                if resp.status_code < 500 and resp.status_code != 429:
                    return resp
                err: OnceflowError = error_from_response(resp, what)
            except httpx.TransportError as exc:
                err = TransportError(f"{what}: {exc!r}")
            if loop.time() > deadline:
                raise err
            attempt += 1
            low, high = self.retry_backoff
            await asyncio.sleep(min(high, low * 2 ** min(attempt, 16)) * (0.8 + 0.4 * random.random()))  # noqa: S311

    def _note(self, err: OnceflowError) -> OnceflowError:
        if err.status == 403:
            self._fenced = err
        return err

    def _check(self) -> None:
        if self._fenced is not None:
            raise self._fenced
        if self.epoch < 0:
            raise OnceflowError("init() the transactional producer first")

    # ------------------------------------------------------------------ lifecycle

    async def init(self) -> None:
        """Claim the transactional id: a new epoch; the previous holder is fenced and whatever it
        left open is aborted."""
        # one request id for the retries of this init: a retry (or a late original) gets the same
        # epoch back instead of fencing this very producer with a newer one
        request = {"timeout_ms": self.timeout_ms, "request_id": uuid.uuid4().hex}
        body = await self._post_json(self._url("init"), request, f"init {self.transactional_id}")
        self.producer_id, self.epoch, self.txn, self._ended = body["producer_id"], body["epoch"], None, body["txn"]
        self._seqs.clear()
        self._buffers.clear()
        self._buffer_bytes.clear()

    def resume(self, producer_id: str, epoch: int, txn: int) -> None:
        """Write with an epoch that the server issued for this id by other means (the Spark
        sink's ``/v1/sinks/<sink>/begin`` initialises its tasks' ids itself), instead of
        :meth:`init`. ``txn``: the number of the id's last transaction, as the init answered."""
        self.producer_id, self.epoch, self.txn, self._ended = producer_id, epoch, None, txn
        self._seqs.clear()
        self._buffers.clear()
        self._buffer_bytes.clear()
        self._fenced = None

    async def __aenter__(self) -> AsyncTransactionalProducer:
        await self.init()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Release the HTTP client. An open transaction is left to the server's timeout (or the
        next instance's init), never committed."""
        if self._own:
            await self._client.aclose()

    # ------------------------------------------------------------------ writing

    async def _content_type(self, stream: str) -> str:
        ct = self._types.get(stream)
        if ct is None:
            resp = await self._request("HEAD", stream_url(self.base_url, stream), f"head {stream}")
            if resp.status_code != 200:
                raise error_from_response(resp, f"head {stream}")
            ct = self._types[stream] = resp.headers.get("content-type", "application/octet-stream")
        return ct

    async def append(self, stream: str, value: bytes | str | Any) -> None:
        """Add one message to the open transaction (buffered; sent when the buffer fills)."""
        await self.extend(stream, (value,))

    async def extend(self, stream: str, values: Iterable[bytes | str | Any]) -> None:
        """Add many messages to the open transaction at once."""
        self._check()
        json_stream = is_json_type(await self._content_type(stream))
        buf = self._buffers.setdefault(stream, [])
        size = self._buffer_bytes.get(stream, 0)
        for value in values:
            if type(value) is bytes:
                data = value
            elif isinstance(value, bytes | bytearray):
                data = bytes(value)
            elif json_stream:
                data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
            elif isinstance(value, str):
                data = value.encode()
            else:
                raise TypeError(f"cannot append {type(value).__name__} to the non-JSON stream {stream!r}")
            buf.append(data)
            size += len(data) + 1
        self._buffer_bytes[stream] = size
        if size >= self.max_batch_bytes:
            await self._send(stream)

    async def _send(self, stream: str, *, commit: int | None = None) -> bool:
        """POST the buffered messages of ``stream``; with ``commit``, as the last append of that
        transaction, which commits it. Returns whether the server says it committed."""
        msgs = self._buffers.pop(stream, [])
        self._buffer_bytes.pop(stream, None)
        if not msgs:
            return False
        ct = await self._content_type(stream)
        body = b"[" + b",".join(msgs) + b"]" if is_json_type(ct) else b"".join(msgs)
        seq = self._seqs.get(stream, 0)
        headers = {
            "content-type": ct,
            "producer-id": self.producer_id,
            "producer-epoch": str(self.epoch),
            "producer-seq": str(seq),
            "transaction-id": self.transactional_id,
        }
        if commit is not None:
            headers["transaction-commit"] = str(commit)
        resp = await self._request("POST", stream_url(self.base_url, stream), f"append to {stream}", content=body, headers=headers)
        if resp.status_code not in (200, 204):
            raise self._note(error_from_response(resp, f"transactional append to {stream}"))
        self._seqs[stream] = seq + 1
        number = resp.headers.get("transaction-number")
        if number is not None and number.isdigit():
            if self.txn is not None and int(number) != self.txn:
                # the server ended our transaction (a timeout) and this append began another one
                self._fenced = OnceflowError(
                    f"transaction {self.txn} of {self.transactional_id!r} was aborted by the server; init() again",
                    code="transaction_aborted",
                )
                raise self._fenced
            self.txn = int(number)
        return bool(resp.headers.get("transaction-committed") == "true")

    async def flush(self) -> None:
        """Send every buffered message (still inside the transaction)."""
        self._check()
        await asyncio.gather(*(self._send(s) for s in list(self._buffers)))

    async def send_offsets_to_transaction(self, group: str, offsets: Mapping[str, str]) -> None:
        """Commit ``group``'s ``offsets`` together with this transaction's output."""
        self._check()
        if not offsets:
            return
        body = await self._post_json(
            self._url("offsets"), {"epoch": self.epoch, "group": group, "offsets": dict(offsets)}, f"offsets of {group}"
        )
        self.txn = body["txn"]

    async def commit(self) -> None:
        """Send what is buffered, then commit. A no-op when the transaction wrote nothing.

        The last buffered batch carries the commit (``Transaction-Commit``), so a transaction
        whose messages fit one request is one request; a transaction that wrote to one stream only
        and carries no offsets is then stored with one fsync on the server."""
        self._check()
        pending = [stream for stream, msgs in self._buffers.items() if msgs]
        committed = False
        if pending:
            await asyncio.gather(*(self._send(stream) for stream in pending[:-1]))
            number = self.txn if self.txn is not None else self._ended + 1
            committed = await self._send(pending[-1], commit=number)
        if self.txn is None:
            return
        if not committed:  # nothing was left to send (or a server without Transaction-Commit)
            await self._post_json(self._url("commit"), {"epoch": self.epoch, "txn": self.txn}, f"commit {self.transactional_id}")
        self._ended, self.txn = self.txn, None

    async def abort(self) -> None:
        """Drop what is buffered and abort what was sent."""
        self._buffers.clear()
        self._buffer_bytes.clear()
        if self.txn is None or self._fenced is not None:
            self.txn = None
            return
        await self._post_json(self._url("abort"), {"epoch": self.epoch, "txn": self.txn}, f"abort {self.transactional_id}")
        self._ended, self.txn = self.txn, None

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncTransactionalProducer]:
        """Commit when the block ends normally; abort (and re-raise) when it raises."""
        self._check()
        try:
            yield self
        except BaseException:
            with contextlib.suppress(OnceflowError):
                await self.abort()
            raise
        await self.commit()


class TransactionalProducer:
    """The blocking twin of :class:`AsyncTransactionalProducer` (same arguments; ``init`` runs in
    the constructor)."""

    def __init__(self, base_url: str, transactional_id: str, **kw: Any) -> None:
        background_loop()
        self._core = AsyncTransactionalProducer(base_url, transactional_id, **kw)
        try:
            run_sync(self._core.init())
        except BaseException:
            run_sync(self._core.close())  # no one else holds it to close
            raise

    @property
    def epoch(self) -> int:
        return self._core.epoch

    @property
    def producer_id(self) -> str:
        return self._core.producer_id

    @property
    def txn(self) -> int | None:
        """The server's number of the open transaction, once something was sent in it."""
        return self._core.txn

    def append(self, stream: str, value: bytes | str | Any) -> None:
        run_sync(self._core.append(stream, value))

    def extend(self, stream: str, values: Iterable[bytes | str | Any]) -> None:
        run_sync(self._core.extend(stream, list(values)))

    def flush(self) -> None:
        run_sync(self._core.flush())

    def send_offsets_to_transaction(self, group: str, offsets: Mapping[str, str]) -> None:
        run_sync(self._core.send_offsets_to_transaction(group, offsets))

    def commit(self) -> None:
        run_sync(self._core.commit())

    def abort(self) -> None:
        run_sync(self._core.abort())

    @contextlib.contextmanager
    def transaction(self) -> Iterator[TransactionalProducer]:
        """Commit when the block ends normally; abort (and re-raise) when it raises."""
        self._core._check()
        try:
            yield self
        except BaseException:
            with contextlib.suppress(OnceflowError):
                self.abort()
            raise
        self.commit()

    def close(self) -> None:
        run_sync(self._core.close())

    def __enter__(self) -> TransactionalProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GroupOffsetStore:
    """Consumer-group offsets kept by the onceflow server (``/v1/groups/<group>/offsets``).

    With ``delivery="exactly-once"`` a consumer reads its start from here and never commits itself:
    a :class:`TransactionalProducer` commits the offsets with its output.
    """

    def __init__(self, base_url: str, *, member_epoch: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.member_epoch = member_epoch

    def _url(self, group: str) -> str:
        return f"{self.base_url}/v1/groups/{group}/offsets"

    def load(self, group: str, stream: str) -> str | None:
        with httpx.Client(timeout=30.0, verify=tls_verify(self.base_url), headers=auth_headers()) as c:
            try:
                resp = c.get(self._url(group))
            except httpx.TransportError as exc:
                raise TransportError(f"load offsets of {group}: {exc!r}") from exc
        if resp.status_code != 200:
            raise error_from_response(resp, f"load offsets of {group}")
        offsets: dict[str, str] = resp.json()["offsets"]
        return offsets.get(stream)

    def commit(self, group: str, offsets: Mapping[str, str]) -> None:
        body: dict[str, Any] = {"offsets": dict(offsets)}
        if self.member_epoch is not None:
            body["member_epoch"] = self.member_epoch
        with httpx.Client(timeout=30.0, verify=tls_verify(self.base_url), headers=auth_headers()) as c:
            try:
                resp = c.post(self._url(group), json=body)
            except httpx.TransportError as exc:
                raise TransportError(f"commit offsets of {group}: {exc!r}") from exc
        if resp.status_code != 200:
            raise error_from_response(resp, f"commit offsets of {group}")
