"""The client's errors (all under the package root :class:`~onceflow.errors.OnceflowError`), and one
mapper from responses to them."""

from __future__ import annotations

import json

import httpx

from ..errors import OnceflowError

__all__ = [
    "AbortRequiredError",
    "BadRequestError",
    "CommitOutcomeUnknownError",
    "ConflictError",
    "ContentTypeMismatchError",
    "ForbiddenError",
    "OffsetGoneError",
    "OnceflowError",
    "OutcomeUnknownError",
    "PayloadTooLargeError",
    "PreconditionFailedError",
    "ProducerFencedError",
    "SequenceGapError",
    "ServerError",
    "StreamClosedError",
    "StreamGoneError",
    "StreamNotFoundError",
    "TransportError",
    "UnknownTransactionalIdError",
    "error_from_response",
]


class BadRequestError(OnceflowError):
    """400: the request was malformed; resending it unchanged will fail again."""


class StreamNotFoundError(OnceflowError):
    """404: no stream at this URL."""


class StreamGoneError(OnceflowError):
    """410: the stream was deleted (its forks keep its data)."""


class OffsetGoneError(OnceflowError):
    """410 ``offset_gone``: retention deleted the data at the offset read; ``earliest_offset`` is the
    first offset the stream still has (reading on from there skips what was deleted)."""

    def __init__(
        self,
        message: str,
        *,
        earliest_offset: str,
        status: int | None = None,
        code: str = "offset_gone",
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, retriable=retriable)
        self.earliest_offset = earliest_offset


class ConflictError(OnceflowError):
    """409: the stream exists with another configuration, or a Stream-Seq went backwards."""


class ContentTypeMismatchError(ConflictError):
    """409: the data's content type is not the stream's."""


class StreamClosedError(ConflictError):
    """409 with Stream-Closed: the stream is closed; ``next_offset`` is its final offset."""

    def __init__(
        self,
        message: str,
        *,
        next_offset: str | None = None,
        status: int | None = None,
        code: str = "",
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, retriable=retriable)
        self.next_offset = next_offset


class SequenceGapError(ConflictError):
    """409 with Producer-Expected-Seq: a producer's batch arrived before an earlier one."""

    def __init__(
        self,
        message: str,
        *,
        expected_seq: int,
        received_seq: int,
        status: int | None = None,
        code: str = "",
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, retriable=retriable)
        self.expected_seq = expected_seq
        self.received_seq = received_seq


class ProducerFencedError(OnceflowError):
    """403: a newer epoch of this producer id exists (this producer is a zombie)."""

    def __init__(
        self,
        message: str,
        *,
        current_epoch: int | None = None,
        status: int | None = None,
        code: str = "",
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, retriable=retriable)
        self.current_epoch = current_epoch


class ForbiddenError(OnceflowError):
    """403 ``forbidden``: the server's guard does not let this token do this (docs/security.md);
    sending it again with the same token fails again. Not a fenced producer."""


class UnknownTransactionalIdError(OnceflowError):
    """404 ``unknown_transactional_id``: the server knows no transactional id of this name (it was
    never initialised there, or its state was removed); ``init`` it first."""


class PreconditionFailedError(OnceflowError):
    """412: If-Match named a tail that is no longer the stream's tail (``next_offset`` is)."""

    def __init__(
        self,
        message: str,
        *,
        next_offset: str | None = None,
        status: int | None = None,
        code: str = "",
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, retriable=retriable)
        self.next_offset = next_offset


class PayloadTooLargeError(OnceflowError):
    """413: the body exceeds the server's limit."""


class ServerError(OnceflowError):
    """5xx or 429: the server could not do it now; the same request may succeed later."""

    retriable = True


class TransportError(OnceflowError):
    """No (complete) response: connection refused or dropped, timeout. Retriable."""

    retriable = True


class OutcomeUnknownError(TransportError):
    """A write got no definite answer before the delivery timeout: every attempt ended without a
    (complete) response, or with a 5xx or 429, and at least one may have reached the server. The
    write may or may not have been stored, and a request still under way may yet be. ``status`` is
    the last attempt's (None: no response).

    Not retriable by sending something new: an idempotent producer fails for good (only the same
    producer id, epoch and sequence could be resent); a transactional producer must ``abort()``,
    which begins a new epoch on the server (see :class:`AbortRequiredError`)."""

    retriable = False


class CommitOutcomeUnknownError(OutcomeUnknownError):
    """A transaction's commit got no definite answer: it may or may not have committed. ``txn`` is
    its number. Call ``commit()`` again: it resends the same request, which the server answers as
    committed if it was, and commits now if it was not; ``abort()`` is refused until then."""

    def __init__(
        self, message: str, *, txn: int, status: int | None = None, code: str = "", retriable: bool | None = None
    ) -> None:
        super().__init__(message, status=status, code=code, retriable=retriable)
        self.txn = txn


class AbortRequiredError(OnceflowError):
    """The open transaction cannot commit: one of its writes failed or its outcome is unknown
    (``cause``). ``abort()`` it (``transaction()`` does when its block raises) and begin again."""

    def __init__(
        self,
        message: str,
        *,
        cause: BaseException,
        status: int | None = None,
        code: str = "",
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, retriable=retriable)
        self.cause = cause


def _message(resp: httpx.Response) -> tuple[str, str]:
    try:
        err = json.loads(resp.content)["error"]
        return str(err.get("message", "")), str(err.get("code", ""))
    except (ValueError, KeyError, TypeError):
        text = resp.content[:300].decode("utf-8", "replace").strip()
        return text or resp.reason_phrase, ""


def error_from_response(resp: httpx.Response, what: str = "") -> OnceflowError:
    """The exception for a non-success response: by the answer's error ``code`` where it tells more
    than its status (server/answers.py has the server's table; tests/client/test_error_mapping.py
    checks every code), else by its status."""
    status = resp.status_code
    message, code = _message(resp)
    msg = f"{what}: {message}" if what else message
    h = resp.headers
    if code == "forbidden":  # the guard's: the token may not; never a fenced producer
        return ForbiddenError(msg, status=status, code=code, retriable=False)
    if code == "unknown_transactional_id":
        return UnknownTransactionalIdError(msg, status=status, code=code, retriable=False)
    if status == 400:
        return BadRequestError(msg, status=status, code=code)
    if status == 401:
        hint = "the server wants a bearer token it knows: set $ONCEFLOW_TOKEN (in Spark, the option token)"
        return OnceflowError(f"{msg} (401: {hint})", status=status, code=code or "unauthorized")
    if status == 403 and code in ("stale_epoch", ""):
        epoch = h.get("producer-epoch")
        return ProducerFencedError(
            msg,
            status=status,
            code=code or "stale_epoch",
            current_epoch=int(epoch) if epoch and epoch.isdigit() else None,
        )
    if status == 404 and code in ("not_found", ""):
        return StreamNotFoundError(msg, status=status, code=code or "not_found")
    if status == 409:
        if h.get("stream-closed", "").lower() == "true":
            return StreamClosedError(
                msg, status=status, code=code or "stream_closed", next_offset=h.get("stream-next-offset")
            )
        exp, rec = h.get("producer-expected-seq"), h.get("producer-received-seq")
        if exp is not None and rec is not None and exp.isdigit() and rec.isdigit():
            return SequenceGapError(
                msg, status=status, code=code or "sequence_gap", expected_seq=int(exp), received_seq=int(rec)
            )
        if code == "content_type_mismatch":
            return ContentTypeMismatchError(msg, status=status, code=code)
        return ConflictError(msg, status=status, code=code)
    if status == 410:
        earliest = h.get("stream-earliest-offset")
        if code == "offset_gone" and earliest:
            return OffsetGoneError(msg, status=status, earliest_offset=earliest)
        return StreamGoneError(msg, status=status, code=code or "gone")
    if status == 412:
        return PreconditionFailedError(
            msg, status=status, code=code or "tail_mismatch", next_offset=h.get("stream-next-offset")
        )
    if status == 400:
        return BadRequestError(msg, status=status, code=code)
    if status == 413:
        return PayloadTooLargeError(msg, status=status, code=code or "payload_too_large")
    if status == 429 or status >= 500:
        return ServerError(msg, status=status, code=code)
    return OnceflowError(msg, status=status, code=code)
