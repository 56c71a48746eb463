"""Every answer the server can give maps to the exception a user should see (issue 28: the client
picked the exception by status alone, so a guard's ``403 forbidden`` became ``ProducerFencedError``,
after which a transactional producer took itself for fenced, and an unknown transactional id's 404
became ``StreamNotFoundError``). The mapping goes by the answer's ``code``, as the server's table
(``server/answers.py``) gives it, and by status only for answers without one."""

from __future__ import annotations

import json

import httpx
import pytest

from onceflow.client import (
    BadRequestError,
    ConflictError,
    ContentTypeMismatchError,
    ForbiddenError,
    OffsetGoneError,
    OnceflowError,
    PayloadTooLargeError,
    PreconditionFailedError,
    ProducerFencedError,
    SequenceGapError,
    ServerError,
    StreamClosedError,
    StreamGoneError,
    StreamNotFoundError,
    UnknownTransactionalIdError,
)
from onceflow.client._errors import error_from_response
from onceflow.core.refusal import Refusal
from onceflow.server.answers import ANSWERS

# (status, code) -> the exception a user should see; the headers a refusal of that kind carries
EXPECTED: dict[tuple[int, str], type[OnceflowError]] = {
    (400, "bad_request"): BadRequestError,
    (400, "invalid_epoch_seq"): BadRequestError,
    (400, "INVALID_REQUEST"): BadRequestError,
    (400, "WEBHOOK_URL_REJECTED"): BadRequestError,
    (400, "bad_seal"): BadRequestError,
    (400, "disconnected"): BadRequestError,
    (400, "bad_encoding"): BadRequestError,
    (401, "TOKEN_INVALID"): OnceflowError,
    (401, "unauthorized"): OnceflowError,
    (403, "stale_epoch"): ProducerFencedError,
    (403, "forbidden"): ForbiddenError,
    (404, "not_found"): StreamNotFoundError,
    (404, "unknown_transactional_id"): UnknownTransactionalIdError,
    (404, "NOT_FOUND"): OnceflowError,
    (404, "SUBSCRIPTION_NOT_FOUND"): OnceflowError,
    (405, "method_not_allowed"): OnceflowError,
    (409, "config_conflict"): ConflictError,
    (409, "content_type_mismatch"): ContentTypeMismatchError,
    (409, "stream_closed"): StreamClosedError,
    (409, "stream_seq_conflict"): ConflictError,
    (409, "sequence_gap"): SequenceGapError,
    (409, "txn_refused"): ConflictError,
    (409, "sink_owned"): ConflictError,
    (409, "in_use"): ConflictError,
    (409, "replay_mismatch"): ConflictError,
    (409, "SUBSCRIPTION_ALREADY_EXISTS"): ConflictError,
    (409, "FENCED"): ConflictError,
    (409, "ALREADY_CLAIMED"): ConflictError,
    (409, "NO_PENDING_WORK"): ConflictError,
    (409, "INVALID_OFFSET"): ConflictError,
    (410, "gone"): StreamGoneError,
    (410, "offset_gone"): OffsetGoneError,
    (412, "tail_mismatch"): PreconditionFailedError,
    (413, "payload_too_large"): PayloadTooLargeError,
    (413, "PAYLOAD_TOO_LARGE"): PayloadTooLargeError,
    (415, "unsupported_encoding"): OnceflowError,
    (429, "limit"): ServerError,
    (429, "limit_exceeded"): ServerError,
    (500, "internal"): ServerError,
    (502, "leader_unreachable"): ServerError,
    (503, "concurrent_transactions"): ServerError,
    (503, "unavailable"): ServerError,
    (503, "outcome_unknown"): ServerError,
    (503, "not_leader"): ServerError,
    (503, "lease_changed"): ServerError,
    (503, "forward_buffer_full"): ServerError,
    (503, "starting"): ServerError,
    (503, "UNAVAILABLE"): ServerError,
    (503, "OUTCOME_UNKNOWN"): ServerError,
}

HEADERS: dict[str, dict[str, str]] = {
    "stream_closed": {"stream-closed": "true", "stream-next-offset": "0000000000000001_0000000000000008"},
    "sequence_gap": {"producer-expected-seq": "3", "producer-received-seq": "5"},
    "offset_gone": {"stream-earliest-offset": "0000000000000002_0000000000000010"},
    "tail_mismatch": {"stream-next-offset": "0000000000000001_0000000000000008"},
    "stale_epoch": {"producer-epoch": "4"},
}


def _answer(status: int, code: str) -> httpx.Response:
    body = json.dumps({"error": {"code": code, "message": f"a {code} answer"}}).encode()
    return httpx.Response(status, content=body, headers={"content-type": "application/json", **HEADERS.get(code, {})})


def test_every_refusal_of_the_servers_table_is_in_this_table() -> None:
    """A refusal added to the server's table without a line here fails: say what a user sees."""
    missing = {(a.status, a.code) for a in ANSWERS.values()} - set(EXPECTED)
    assert not missing, f"add these answers to EXPECTED: {sorted(missing)}"
    assert all(r in ANSWERS for r in Refusal)


@pytest.mark.parametrize(("status", "code"), sorted(EXPECTED))
def test_each_answer_maps_to_the_exception_a_user_should_see(status: int, code: str) -> None:
    err = error_from_response(_answer(status, code))
    assert type(err) is EXPECTED[(status, code)], (status, code, type(err).__name__)
    assert err.status == status and err.code == code


def test_a_guards_refusal_does_not_fence_and_an_unknown_id_is_no_missing_stream() -> None:
    forbidden = error_from_response(_answer(403, "forbidden"))
    assert not isinstance(forbidden, ProducerFencedError) and not forbidden.retriable
    unknown = error_from_response(_answer(404, "unknown_transactional_id"))
    assert not isinstance(unknown, StreamNotFoundError) and not unknown.retriable
    fenced = error_from_response(_answer(403, "stale_epoch"))
    assert isinstance(fenced, ProducerFencedError) and fenced.current_epoch == 4


def test_answers_without_a_code_are_mapped_by_status_as_before() -> None:
    """A proxy's or another server's answer carries no onceflow code."""
    assert type(error_from_response(httpx.Response(403, text="nope"))) is ProducerFencedError
    assert type(error_from_response(httpx.Response(404, text="nope"))) is StreamNotFoundError
    assert type(error_from_response(httpx.Response(502, text="bad gateway"))) is ServerError
