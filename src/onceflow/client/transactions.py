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
instance of the same transactional id took over: this one is fenced for good (make a new one, or
``init()`` again).

When a write fails, or its outcome is unknown
    Every request is retried on transport errors and 5xx until ``delivery_timeout``. A write that
    still has no definite answer then raises :class:`OutcomeUnknownError`: the server may have
    stored it (the answer was lost) or may yet store it (the request is still under way).

    1. A transaction one of whose writes failed, or whose outcome is unknown, can never commit:
       ``commit()``, ``append()``, ``extend()``, ``flush()`` and ``send_offsets_to_transaction()``
       raise :class:`AbortRequiredError` until ``abort()``.
    2. After an unknown outcome ``abort()`` knows neither the stream's sequence nor, if it was the
       transaction's first write, the transaction's number. So it takes a new epoch (Kafka's
       KIP-360): ``init`` with a fresh request id, which aborts whatever the old epoch left open,
       fences any request of the old epoch still under way (403), and restarts the sequences at 0.
       Before that it checks (``GET /v1/txn/<id>``) that the id is still at this producer's epoch:
       if it moved on (a newer instance took over, or the server aborted the transaction after its
       timeout), this producer is fenced instead and takes nothing from the newer holder.
    3. A commit whose outcome is unknown raises :class:`CommitOutcomeUnknownError`. ``commit()``
       again resends the very same request, which the server answers idempotently: committed if it
       was, committed now if it was not, or a definite error if the transaction can no longer
       commit. ``abort()`` and new writes are refused until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import uuid
from bisect import bisect_left
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import accumulate
from operator import add
from typing import Any, assert_never

import httpx

from .._backoff import backoff
from ._errors import (
    AbortRequiredError,
    CommitOutcomeUnknownError,
    OnceflowError,
    OutcomeUnknownError,
    ProducerFencedError,
    TransportError,
    error_from_response,
)
from ._loop import background_loop, run_sync
from .lowlevel import (
    Coding,
    ServerURL,
    async_http_client,
    check_compression,
    encode_body,
    http_client,
    is_json_type,
    request_url,
    server_url,
    stream_url,
)

__all__ = ["AsyncTransactionalProducer", "GroupOffsetStore", "TransactionalProducer", "TxnProducerState"]

# transport errors raised before a byte of the request could have reached the server
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class TxnProducerState(enum.Enum):
    """Where an :class:`AsyncTransactionalProducer` stands (its ``state``). The producer moves from
    one to another only as ``_MOVES`` allows (``AsyncTransactionalProducer._move``)."""

    UNINITIALISED = "uninitialised"  # no epoch yet: init() (or resume()) first
    READY = "ready"  # no transaction open: the next write begins one
    IN_TXN = "in_txn"  # a transaction is open: something was added to it since the last end
    ABORT_REQUIRED = "abort_required"  # a write was refused: only abort(), a request in this epoch
    ABORT_BY_NEW_EPOCH = "abort_by_new_epoch"  # a write may be stored unseen: only abort(), by a new epoch
    COMMIT_UNKNOWN = "commit_unknown"  # a commit had no definite answer: only commit() again
    FENCED = "fenced"  # the id moved on past this epoch: only init() again

    def can_become(self, new: TxnProducerState) -> bool:
        return new in _MOVES[self]


_S = TxnProducerState
# Every state goes to READY on init() or resume() (a new epoch), and to FENCED on a 403 (an init's
# too). ABORT_REQUIRED -> ABORT_BY_NEW_EPOCH: one of a flush's concurrent appends lost its answer
# after another was refused. COMMIT_UNKNOWN -> IN_TXN: commit() again got an answer, which is then
# taken as a first try's would be (READY, ABORT_REQUIRED or FENCED). A failed write that finds the
# transaction already waiting for its abort keeps the first failure: no move.
_MOVES: dict[TxnProducerState, frozenset[TxnProducerState]] = {
    _S.UNINITIALISED: frozenset({_S.READY, _S.FENCED}),
    _S.READY: frozenset({_S.READY, _S.IN_TXN, _S.FENCED}),
    _S.IN_TXN: frozenset({_S.READY, _S.ABORT_REQUIRED, _S.ABORT_BY_NEW_EPOCH, _S.COMMIT_UNKNOWN, _S.FENCED}),
    _S.ABORT_REQUIRED: frozenset({_S.READY, _S.ABORT_BY_NEW_EPOCH, _S.FENCED}),
    _S.ABORT_BY_NEW_EPOCH: frozenset({_S.READY, _S.FENCED}),
    _S.COMMIT_UNKNOWN: frozenset({_S.READY, _S.IN_TXN, _S.COMMIT_UNKNOWN, _S.FENCED}),
    _S.FENCED: frozenset({_S.READY, _S.FENCED}),
}
_ABORTING = frozenset({_S.ABORT_REQUIRED, _S.ABORT_BY_NEW_EPOCH})  # waiting for abort()
_FAILED = _ABORTING | {_S.FENCED}  # the states that hold the failure that led there


@dataclass(frozen=True, slots=True)
class _Commit:
    """A commit request: an append carrying ``Transaction-Commit`` (``stream`` set), or
    ``POST /v1/txn/<id>/commit``. Kept whole while its outcome is unknown, to be sent again as it was."""

    txn: int
    url: str
    body: bytes
    headers: dict[str, str]
    stream: str | None = None
    seq: int = 0


class AsyncTransactionalProducer:
    """A transactional producer for one transactional id, on the running event loop.

    One caller at a time: the methods are not meant to run concurrently with each other.

    ``compression`` (``"gzip"`` or ``"zstd"``): each append request of 1 KiB or more goes compressed;
    the server decodes it before the transaction sees it, so a commit, an abort or a retry is what
    it would be uncompressed.

    ``state`` (:class:`TxnProducerState`) is one of these; ``_move`` changes it, and only along
    ``_MOVES`` (any other move is a bug here, an ``AssertionError``). ``init()``, ``resume()`` and
    ``close()`` are allowed in every state; ``init()`` and ``resume()`` lead to READY (a 403 on
    ``init()`` to FENCED).

    ==================  ===============================  ==============================================
    state               entered when                     the other calls
    ==================  ===============================  ==============================================
    UNINITIALISED       constructed                      raise ``OnceflowError`` (``abort()``: no-op)
    READY               init, commit, abort              allowed; a write moves to IN_TXN
    IN_TXN              append, extend, offsets sent     allowed; commit/abort -> READY; a write that
                                                         fails -> ABORT_*, a commit without answer
                                                         -> COMMIT_UNKNOWN, a 403 -> FENCED
    ABORT_REQUIRED      a write refused, an abort        ``abort()`` (a request) -> READY; the others
                        failed                           raise ``AbortRequiredError``
    ABORT_BY_NEW_EPOCH  a write without definite answer  ``abort()`` (a new epoch) -> READY or FENCED;
                                                         the others raise ``AbortRequiredError``
    COMMIT_UNKNOWN      a commit without definite        ``commit()`` (sent again); the others raise
                        answer                           ``CommitOutcomeUnknownError``
    FENCED              a 403; the id moved on           ``abort()`` drops the buffers; the others
                                                         raise the fencing error
    ==================  ===============================  ==============================================
    """

    def __init__(
        self,
        base_url: ServerURL,
        transactional_id: str,
        *,
        timeout_ms: int = 60_000,
        max_batch_bytes: int = 1 << 20,
        retry_backoff: tuple[float, float] = (0.05, 2.0),
        delivery_timeout: float = 60.0,
        client: httpx.AsyncClient | None = None,
        token: str | None = None,
        compression: Coding | None = None,
    ) -> None:
        self.compression = check_compression(compression)
        self.base_url = server_url(base_url).rstrip("/")
        self._api = request_url(self.base_url)  # what requests are addressed to (the same URL for one server)
        self.transactional_id = transactional_id
        self.timeout_ms = timeout_ms
        self.max_batch_bytes = max_batch_bytes
        self.retry_backoff = retry_backoff
        self.delivery_timeout = delivery_timeout
        self._own = client is None
        self._client = client or async_http_client(self.base_url, timeout=30.0, token=token)
        self._closed = False  # its own client was closed: every call is refused (_refuse_closed)
        self.producer_id = ""
        self.epoch = -1
        self.txn: int | None = None  # the server's number of the open transaction, once known
        self._ended = 0  # the number of the last transaction this instance ended (0 after init)
        self._seqs: dict[str, int] = {}
        self._buffers: dict[str, list[bytes]] = {}
        self._buffer_bytes: dict[str, int] = {}
        self._types: dict[str, str] = {}
        self._state = TxnProducerState.UNINITIALISED  # changed by _move only
        # set by _move with the state: FENCED's error, or the write that made the transaction ABORT_*
        self._failure: BaseException | None = None
        self._commit: _Commit | None = None  # COMMIT_UNKNOWN's request, to be sent again as it was
        self._bump_id: str | None = None  # the request id of the epoch bump under way (the same on every try)

    def _url(self, path: str) -> str:
        return f"{self._api}/v1/txn/{self.transactional_id}/{path}"

    async def _post_json(self, url: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        resp = await self._request("POST", url, what, json=body)
        if resp.status_code != 200:
            raise self._note(error_from_response(resp, what))
        result: dict[str, Any] = resp.json()
        return result

    async def _request(self, method: str, url: str, what: str, *, write: bool = False, **kw: Any) -> httpx.Response:
        """One request, retried on transport errors and 5xx (every request here is idempotent).

        Gives up after ``delivery_timeout`` with the last error or, for a ``write`` that may have
        reached the server on some attempt, :class:`OutcomeUnknownError`."""
        self._refuse_closed()  # before anything is sent: a definite "not sent"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.delivery_timeout
        attempt = 0
        reached = False
        while True:
            try:
                resp = await self._client.request(method, url, **kw)
                if resp.status_code < 500 and resp.status_code != 429:
                    return resp
                err: OnceflowError = error_from_response(resp, what)
                reached = True
            except httpx.TransportError as exc:
                err = TransportError(f"{what}: {exc!r}")
                # a follower's answer (NoServerError.answered) means it was carried to a server
                reached = reached or not isinstance(exc, _NOT_SENT) or getattr(exc, "answered", False)
            if loop.time() > deadline:
                if write and reached:
                    raise OutcomeUnknownError(
                        f"{what}: no definite answer within {self.delivery_timeout:g} s (last: {err.message}); "
                        "the server may or may not have stored it",
                        status=err.status,
                        code="outcome_unknown",
                    )
                raise err
            attempt += 1
            await asyncio.sleep(backoff(attempt, *self.retry_backoff))

    @property
    def state(self) -> TxnProducerState:
        """Where the producer stands: see the class docstring."""
        return self._state

    def _move(
        self, new: TxnProducerState, *, failure: BaseException | None = None, commit: _Commit | None = None
    ) -> None:
        """The one place the state changes, and only as ``_MOVES`` allows: any other move is a bug
        of this class (``AssertionError``). ``failure``: what FENCED raises, or the write that left
        the transaction ABORT_*; ``commit``: COMMIT_UNKNOWN's request."""
        old = self._state
        if not old.can_become(new):
            raise AssertionError(
                f"transactional producer {self.transactional_id!r}: no move from {old.value} to {new.value}"
            )
        if (failure is not None) != (new in _FAILED) or (commit is not None) != (new is _S.COMMIT_UNKNOWN):
            raise AssertionError(
                f"transactional producer {self.transactional_id!r}: {new.value} with failure={failure!r}, commit={commit!r}"
            )
        self._state, self._failure, self._commit = new, failure, commit

    def _note(self, err: OnceflowError) -> OnceflowError:
        if err.status == 403:
            self._move(_S.FENCED, failure=err)
        return err

    def _doom(self, exc: BaseException, *, unknown: bool) -> None:
        """A write of the open transaction failed (``unknown``: it may have been stored): the
        transaction can only be aborted now (by a new epoch if ``unknown``). The first failure is
        the one kept; fenced, nothing changes."""
        state = self._state
        if state is _S.FENCED or state is _S.ABORT_BY_NEW_EPOCH or (state is _S.ABORT_REQUIRED and not unknown):
            return
        self._move(
            _S.ABORT_BY_NEW_EPOCH if unknown else _S.ABORT_REQUIRED,
            failure=self._failure if state is _S.ABORT_REQUIRED else exc,
        )

    def _failed_write(self, exc: BaseException) -> None:
        """Note a write that raised: no definite answer (an unknown outcome, or cancelled while
        under way) or a definite refusal (403 fences the producer)."""
        if isinstance(exc, OnceflowError):
            if exc.status == 403:
                self._move(_S.FENCED, failure=exc)
            else:
                self._doom(exc, unknown=isinstance(exc, OutcomeUnknownError))
        else:
            self._doom(exc, unknown=True)  # cancelled (or interrupted) while the request was out

    @property
    def fenced(self) -> bool:
        """Whether the id moved on past this producer (a newer instance's ``init``, or the server
        fencing a transaction that outlived its timeout): it can do nothing more; ``init()`` again
        (which fences any other holder) or give way."""
        return self._state is _S.FENCED

    def _check_open(self) -> None:
        """Raise, as the state says, unless the open transaction (or the next) may take writes and
        commit: the one check of every call that writes or commits."""
        self._refuse_closed()
        state = self._state
        if state is _S.READY or state is _S.IN_TXN:
            return
        if state is _S.FENCED:
            assert self._failure is not None
            raise self._failure
        if state is _S.UNINITIALISED:
            raise OnceflowError("init() the transactional producer first")
        if state is _S.COMMIT_UNKNOWN:
            assert self._commit is not None
            raise CommitOutcomeUnknownError(
                f"the outcome of the commit of transaction {self._commit.txn} of {self.transactional_id!r} is unknown: "
                "call commit() again to learn it",
                txn=self._commit.txn,
                code="commit_outcome_unknown",
            )
        if state is _S.ABORT_REQUIRED or state is _S.ABORT_BY_NEW_EPOCH:
            assert self._failure is not None
            raise AbortRequiredError(
                f"the open transaction of {self.transactional_id!r} cannot commit, a write of it failed "
                f"({self._failure!r}): abort() it and begin again",
                cause=self._failure,
                code="abort_required",
            )
        assert_never(state)

    def _open(self) -> None:
        """Something is added to the transaction (after :meth:`_check_open`): it is open."""
        if self._state is _S.READY:
            self._move(_S.IN_TXN)

    def _owes_abort(self) -> bool:
        """Whether the open transaction failed and waits for ``abort()``."""
        return self._state in _ABORTING

    # ------------------------------------------------------------------ lifecycle

    async def init(self) -> None:
        """Claim the transactional id: a new epoch; the previous holder is fenced and whatever it
        left open is aborted. Also how a fenced producer takes the id back."""
        # one request id for the retries of this init: a retry (or a late original) gets the same
        # epoch back instead of fencing this very producer with a newer one
        request = {"timeout_ms": self.timeout_ms, "request_id": uuid.uuid4().hex}
        body = await self._post_json(self._url("init"), request, f"init {self.transactional_id}")
        self._begin_epoch(body["producer_id"], body["epoch"], body["txn"])

    def _begin_epoch(self, producer_id: str, epoch: int, ended: int) -> None:
        """Write in a new epoch (READY): nothing of the old one is left."""
        self.producer_id, self.epoch, self.txn, self._ended = producer_id, epoch, None, ended
        self._seqs.clear()
        self._buffers.clear()
        self._buffer_bytes.clear()
        self._bump_id = None
        self._move(_S.READY)

    def resume(self, producer_id: str, epoch: int, txn: int) -> None:
        """Write with an epoch that the server issued for this id by other means (the Spark
        sink's ``/v1/sinks/<sink>/begin`` initialises its tasks' ids itself), instead of
        :meth:`init`. ``txn``: the number of the id's last transaction, as the init answered."""
        self._begin_epoch(producer_id, epoch, txn)

    async def __aenter__(self) -> AsyncTransactionalProducer:
        await self.init()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Release the HTTP client. An open transaction is left to the server's timeout (or the
        next instance's init), never committed. A producer that made its own client refuses every
        call after this (``closed``); one given a client leaves it to its owner."""
        if self._own:
            self._closed = True
            await self._client.aclose()

    def _refuse_closed(self) -> None:
        if self._closed:
            raise OnceflowError(
                f"the transactional producer of {self.transactional_id!r} is closed: make a new one", code="closed"
            )

    # ------------------------------------------------------------------ writing

    async def _content_type(self, stream: str) -> str:
        ct = self._types.get(stream)
        if ct is None:
            resp = await self._request("HEAD", stream_url(self._api, stream), f"head {stream}")
            if resp.status_code != 200:
                raise error_from_response(resp, f"head {stream}")
            ct = self._types[stream] = resp.headers.get("content-type", "application/octet-stream")
        return ct

    async def append(self, stream: str, value: bytes | str | Any) -> None:
        """Add one message to the open transaction (buffered; sent when the buffer fills)."""
        await self.extend(stream, (value,))

    async def extend(self, stream: str, values: Iterable[bytes | str | Any]) -> None:
        """Add many messages to the open transaction at once. A request is sent each time the
        buffer reaches ``max_batch_bytes``, so however many are added in one call, each request
        holds about that much (a message larger than it goes with what was buffered before it)."""
        self._check_open()
        json_stream = is_json_type(await self._content_type(stream))
        self._open()
        if type(values) is list and set(map(type, values)) == {bytes}:  # encoded messages (the Spark sink)
            await self._extend_encoded(stream, values)
            return
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
            self._buffers.setdefault(stream, []).append(data)
            size = self._buffer_bytes[stream] = self._buffer_bytes.get(stream, 0) + len(data) + 1
            if size >= self.max_batch_bytes:
                await self._send(stream)

    async def _extend_encoded(self, stream: str, values: list[bytes]) -> None:
        """:meth:`extend` for a list of encoded messages: cut where the buffer reaches
        ``max_batch_bytes``, found by bisection on the running sizes (no bytecode per message)."""
        # ends[k]: the bytes the first k messages take in a request, a comma after each
        ends = list(map(add, accumulate(map(len, values), initial=0), range(len(values) + 1)))
        i, n = 0, len(values)
        while i < n:
            size = self._buffer_bytes.get(stream, 0)
            j = min(n, bisect_left(ends, ends[i] + self.max_batch_bytes - size, lo=i + 1))
            self._buffers.setdefault(stream, []).extend(values[i:j])
            size = self._buffer_bytes[stream] = size + ends[j] - ends[i]
            i = j
            if size >= self.max_batch_bytes:
                await self._send(stream)

    def _take(self, stream: str, commit: int | None = None) -> _Commit | None:
        """The POST for the buffered messages of ``stream`` (taken out of the buffer), or None."""
        msgs = self._buffers.pop(stream, [])
        self._buffer_bytes.pop(stream, None)
        if not msgs:
            return None
        ct = self._types[stream]  # learned by extend() before anything was buffered
        body, coded = encode_body(
            b"[" + b",".join(msgs) + b"]" if is_json_type(ct) else b"".join(msgs), self.compression
        )
        seq = self._seqs.get(stream, 0)
        headers = {
            **coded,
            "content-type": ct,
            "producer-id": self.producer_id,
            "producer-epoch": str(self.epoch),
            "producer-seq": str(seq),
            "transaction-id": self.transactional_id,
        }
        if commit is not None:
            headers["transaction-commit"] = str(commit)
        return _Commit(-1 if commit is None else commit, stream_url(self._api, stream), body, headers, stream, seq)

    async def _send(self, stream: str) -> None:
        """POST the buffered messages of ``stream`` (inside the open transaction)."""
        req = self._take(stream)
        if req is None:
            return
        assert req.stream is not None
        try:
            resp = await self._request(
                "POST", req.url, f"append to {stream}", write=True, content=req.body, headers=req.headers
            )
        except BaseException as exc:
            self._failed_write(exc)
            raise
        if resp.status_code not in (200, 204):
            err = error_from_response(resp, f"transactional append to {stream}")
            self._failed_write(err)
            raise err
        self._seqs[stream] = req.seq + 1
        self._joined(resp)

    def _joined(self, resp: httpx.Response) -> None:
        """Learn the transaction's number from an append's answer."""
        number = resp.headers.get("transaction-number")
        if number is not None and number.isdigit():
            if self.txn is not None and int(number) != self.txn:
                # the server ended our transaction (a timeout) and this append began another one
                err = OnceflowError(
                    f"transaction {self.txn} of {self.transactional_id!r} was aborted by the server; init() again",
                    code="transaction_aborted",
                )
                self._move(_S.FENCED, failure=err)
                raise err
            self.txn = int(number)

    async def _send_all(self, streams: list[str]) -> None:
        """Send the buffers of ``streams`` at once; every request has ended when this returns."""
        results = await asyncio.gather(*(self._send(s) for s in streams), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def flush(self) -> None:
        """Send every buffered message (still inside the transaction)."""
        self._check_open()
        await self._send_all(list(self._buffers))

    async def send_offsets_to_transaction(self, group: str, offsets: Mapping[str, str]) -> None:
        """Commit ``group``'s ``offsets`` together with this transaction's output."""
        self._check_open()
        if not offsets:
            return
        self._open()
        what = f"offsets of {group}"
        try:
            # the transaction the offsets are for (the open one, or the one they begin): a late
            # copy of this request can then never land in a later transaction
            number = self.txn if self.txn is not None else self._ended + 1
            resp = await self._request(
                "POST",
                self._url("offsets"),
                what,
                write=True,
                json={"epoch": self.epoch, "txn": number, "group": group, "offsets": dict(offsets)},
            )
        except BaseException as exc:
            self._failed_write(exc)
            raise
        if resp.status_code != 200:
            err = error_from_response(resp, what)
            self._failed_write(err)
            raise err
        self.txn = resp.json()["txn"]

    async def commit(self) -> None:
        """Send what is buffered, then commit. A no-op when the transaction wrote nothing.

        The last buffered batch carries the commit (``Transaction-Commit``), so a transaction
        whose messages fit one request is one request; a transaction that wrote to one stream only
        and carries no offsets is then stored with one fsync on the server.

        Raises :class:`AbortRequiredError` (and sends nothing) when a write of the transaction
        failed, and :class:`CommitOutcomeUnknownError` when the commit got no definite answer; then
        call ``commit()`` again, which resends that same request."""
        if self._state is _S.COMMIT_UNKNOWN:
            assert self._commit is not None
            await self._send_commit(self._commit)
            return
        self._check_open()
        pending = [stream for stream, msgs in self._buffers.items() if msgs]
        if pending:
            await self._send_all(pending[:-1])
            req = self._take(pending[-1], commit=self.txn if self.txn is not None else self._ended + 1)
            assert req is not None
            await self._send_commit(req)
        elif self.txn is not None:
            await self._send_commit(self._commit_request(self.txn))
        elif self._state is _S.IN_TXN:
            self._move(_S.READY)  # nothing reached the server: nothing to commit

    def _commit_request(self, txn: int) -> _Commit:
        body = json.dumps({"epoch": self.epoch, "txn": txn}).encode()
        return _Commit(txn, self._url("commit"), body, {"content-type": "application/json"})

    async def _send_commit(self, req: _Commit) -> None:
        """Send a commit (again, after an unknown outcome) and take its answer.

        1. No definite answer: the commit is kept, to be sent again as it was; raises
           :class:`CommitOutcomeUnknownError`. (Only when no attempt of a first try can have
           reached the server is it known not to have committed: the transaction can then only be
           aborted.)
        2. A refusal: not committed; the transaction can only be aborted (403: fenced; when
           sending again, a 403 leaves open whether an earlier try committed).
        3. An append stored but not committed (a server without ``Transaction-Commit``): commit
           by request, step 1 onwards.
        4. Committed."""
        what = f"commit transaction {req.txn} of {self.transactional_id!r}"
        resend = self._state is _S.COMMIT_UNKNOWN
        # Step 1
        try:
            resp = await self._request("POST", req.url, what, write=True, content=req.body, headers=req.headers)
        except OnceflowError as exc:
            if isinstance(exc, OutcomeUnknownError) or resend:
                self._move(_S.COMMIT_UNKNOWN, commit=req)
                raise CommitOutcomeUnknownError(
                    f"{what}: no definite answer, it may or may not have committed; call commit() again to learn "
                    f"({exc.message})",
                    txn=req.txn,
                    status=exc.status,
                    code="commit_outcome_unknown",
                ) from exc
            self._failed_write(exc)  # no attempt reached the server: not committed
            raise
        except BaseException:
            self._move(_S.COMMIT_UNKNOWN, commit=req)  # cancelled while under way
            raise
        if resend:
            self._move(_S.IN_TXN)  # an answer at last: taken as a first try's
        # Step 2
        if resp.status_code not in (200, 204):
            err = error_from_response(resp, what)
            if resend and isinstance(err, ProducerFencedError):
                # a newer epoch may have come after the first try committed: still unknown
                err = ProducerFencedError(
                    f"{err.message}; whether an earlier try committed the transaction is unknown",
                    status=err.status,
                    code=err.code,
                    current_epoch=err.current_epoch,
                )
            self._failed_write(err)
            raise err
        if req.stream is not None:
            self._seqs[req.stream] = req.seq + 1
            self._joined(resp)
            # Step 3
            if resp.headers.get("transaction-committed") != "true":
                await self._send_commit(self._commit_request(req.txn))
                return
        # Step 4
        self._ended, self.txn = req.txn, None
        self._move(_S.READY)

    async def abort(self) -> None:
        """Drop what is buffered and abort what was sent.

        After a write whose outcome is unknown this takes a new epoch on the server (see the
        module docstring); raises :class:`ProducerFencedError` if the id moved on to another
        holder meanwhile. Refused (:class:`CommitOutcomeUnknownError`) while a commit's outcome is
        unknown: call ``commit()`` again first."""
        self._refuse_closed()
        state = self._state
        if state is _S.COMMIT_UNKNOWN:
            self._check_open()  # raises
        self._buffers.clear()
        self._buffer_bytes.clear()
        if state is _S.FENCED:
            self.txn = None  # the newer epoch aborted what this one left open
            return
        if state is _S.ABORT_BY_NEW_EPOCH:
            await self._abort_by_new_epoch()
            return
        if self.txn is not None:
            try:
                await self._post_json(
                    self._url("abort"), {"epoch": self.epoch, "txn": self.txn}, f"abort {self.transactional_id}"
                )
            except BaseException as exc:
                self._doom(exc, unknown=False)  # no new writes may join it before the abort is through
                raise
            self._ended, self.txn = self.txn, None
        if state is not _S.UNINITIALISED:
            self._move(_S.READY)

    async def _abort_by_new_epoch(self) -> None:
        """Abort after an unknown outcome: a new epoch, if the id is still this producer's.

        ``init`` naming this producer's epoch (``expected_epoch``, Kafka's KIP-360) and the request
        id of this bump (the same on every try, so a try whose answer was lost is answered with the
        epoch it began, not a second bump). The server aborts the old epoch's open transaction and
        fences its requests still under way; if another holder took the id over meanwhile (or the
        server fenced this epoch after a timeout), the init is refused and changes nothing: this
        producer is fenced."""
        tid = self.transactional_id
        if self._bump_id is None:
            self._bump_id = uuid.uuid4().hex
        request = {"timeout_ms": self.timeout_ms, "request_id": self._bump_id, "expected_epoch": self.epoch}
        resp = await self._request("POST", self._url("init"), f"init {tid}", json=request)
        if resp.status_code == 403:
            epoch = resp.headers.get("producer-epoch", "")
            raise self._fence(int(epoch) if epoch.isdigit() else self.epoch + 1)
        if resp.status_code != 200:
            raise error_from_response(resp, f"init {tid}")
        body: dict[str, Any] = resp.json()
        if body["epoch"] != self.epoch + 1:
            raise self._fence(body["epoch"])
        self._begin_epoch(body["producer_id"], body["epoch"], body["txn"])

    def _fence(self, current: int) -> ProducerFencedError:
        err = ProducerFencedError(
            f"transactional id {self.transactional_id!r} moved on to epoch {current} while epoch {self.epoch} had a write "
            "with no answer: a newer instance took it over, or the server aborted the transaction after its timeout. "
            "Nothing of the open transaction is committed; init() again (or make a new producer)",
            code="fenced",
            current_epoch=current,
        )
        self._move(_S.FENCED, failure=err)
        self.txn = None
        return err

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncTransactionalProducer]:
        """Commit when the block ends normally; abort (and re-raise) when it raises.

        A transaction that an earlier failure left waiting for ``abort()`` (its abort failed
        too) is aborted first. A commit with an unknown outcome raises
        :class:`CommitOutcomeUnknownError` out of the block, not aborted."""
        if self._owes_abort():
            await self.abort()
        self._check_open()
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

    def __init__(
        self,
        base_url: ServerURL,
        transactional_id: str,
        *,
        timeout_ms: int = 60_000,
        max_batch_bytes: int = 1 << 20,
        retry_backoff: tuple[float, float] = (0.05, 2.0),
        delivery_timeout: float = 60.0,
        client: httpx.AsyncClient | None = None,
        token: str | None = None,
        compression: Coding | None = None,
    ) -> None:
        background_loop()
        self._core = AsyncTransactionalProducer(
            base_url,
            transactional_id,
            timeout_ms=timeout_ms,
            max_batch_bytes=max_batch_bytes,
            retry_backoff=retry_backoff,
            delivery_timeout=delivery_timeout,
            client=client,
            token=token,
            compression=compression,
        )
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

    @property
    def fenced(self) -> bool:
        """See :attr:`AsyncTransactionalProducer.fenced`."""
        return self._core.fenced

    @property
    def state(self) -> TxnProducerState:
        """See :attr:`AsyncTransactionalProducer.state`."""
        return self._core.state

    def init(self) -> None:
        """Claim the transactional id again (the constructor did once): see the async twin."""
        run_sync(self._core.init())

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
        """Commit when the block ends normally; abort (and re-raise) when it raises (see the async twin)."""
        if self._core._owes_abort():
            self.abort()
        self._core._check_open()
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

    def __init__(self, base_url: ServerURL, *, member_epoch: int | None = None) -> None:
        self.base_url = server_url(base_url).rstrip("/")
        self._api = request_url(self.base_url)
        self.member_epoch = member_epoch

    def _url(self, group: str) -> str:
        return f"{self._api}/v1/groups/{group}/offsets"

    def _body(self, offsets: Mapping[str, str]) -> dict[str, Any]:
        body: dict[str, Any] = {"offsets": dict(offsets)}
        if self.member_epoch is not None:
            body["member_epoch"] = self.member_epoch
        return body

    @staticmethod
    def _loaded(resp: httpx.Response, group: str, stream: str) -> str | None:
        if resp.status_code != 200:
            raise error_from_response(resp, f"load offsets of {group}")
        offsets: dict[str, str] = resp.json()["offsets"]
        return offsets.get(stream)

    @staticmethod
    def _committed(resp: httpx.Response, group: str) -> None:
        if resp.status_code != 200:
            raise error_from_response(resp, f"commit offsets of {group}")

    def _blocking(self) -> httpx.Client:
        return http_client(self.base_url, timeout=30.0)

    def load(self, group: str, stream: str) -> str | None:
        with self._blocking() as c:
            try:
                resp = c.get(self._url(group))
            except httpx.TransportError as exc:
                raise TransportError(f"load offsets of {group}: {exc!r}") from exc
        return self._loaded(resp, group, stream)

    def commit(self, group: str, offsets: Mapping[str, str]) -> None:
        with self._blocking() as c:
            try:
                resp = c.post(self._url(group), json=self._body(offsets))
            except httpx.TransportError as exc:
                raise TransportError(f"commit offsets of {group}: {exc!r}") from exc
        self._committed(resp, group)

    async def aload(self, group: str, stream: str, client: httpx.AsyncClient) -> str | None:
        """:meth:`load` through an async client (an :class:`AsyncConsumer`'s own)."""
        try:
            resp = await client.get(self._url(group))
        except httpx.TransportError as exc:
            raise TransportError(f"load offsets of {group}: {exc!r}") from exc
        return self._loaded(resp, group, stream)

    async def acommit(self, group: str, offsets: Mapping[str, str], client: httpx.AsyncClient) -> None:
        """:meth:`commit` through an async client (an :class:`AsyncConsumer`'s own)."""
        try:
            resp = await client.post(self._url(group), json=self._body(offsets))
        except httpx.TransportError as exc:
            raise TransportError(f"commit offsets of {group}: {exc!r}") from exc
        self._committed(resp, group)
