"""The one table from the core's refusals to HTTP answers.

The core says why it refuses with a :class:`~onceflow.core.refusal.Refusal` and knows no HTTP;
this module gives each refusal its status code and the error code its JSON body carries
(``{"error": {"code": ..., "message": ...}}``), and says which answers carry ``Retry-After``.
Every member of ``Refusal`` is here (tests/test_vocabulary.py enumerates them). The successes a
broker :class:`~onceflow.core.broker.Outcome` names are here too (:data:`SUCCESS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.broker import OutcomeKind
from ..core.refusal import Refusal

__all__ = ["ANSWERS", "SUCCESS", "Answer", "answer_for"]


@dataclass(frozen=True, slots=True)
class Answer:
    """How a refusal is answered: ``status`` and the body's error ``code``; ``retry_after``: the
    answer carries ``Retry-After: 1`` (the clients retry it)."""

    status: int
    code: str
    retry_after: bool = False


SUCCESS: dict[OutcomeKind, int] = {
    "created": 201,
    "exists": 200,
    "appended": 204,  # 200 for an idempotent producer's new append (its duplicate is 204)
    "duplicate": 204,
    "closed_now": 204,
    "already_closed": 204,
    "deleted": 204,
}

R = Refusal

ANSWERS: dict[Refusal, Answer] = {
    # streams
    R.BAD_REQUEST: Answer(400, "bad_request"),
    R.NOT_FOUND: Answer(404, "not_found"),
    R.GONE: Answer(410, "gone"),
    R.OFFSET_GONE: Answer(410, "offset_gone"),
    R.CONFIG_CONFLICT: Answer(409, "config_conflict"),
    R.CONTENT_TYPE_MISMATCH: Answer(409, "content_type_mismatch"),
    R.STREAM_CLOSED: Answer(409, "stream_closed"),
    R.STREAM_SEQ_CONFLICT: Answer(409, "stream_seq_conflict"),
    R.TAIL_MISMATCH: Answer(412, "tail_mismatch"),
    R.STALE_EPOCH: Answer(403, "stale_epoch"),
    R.INVALID_EPOCH_SEQ: Answer(400, "invalid_epoch_seq"),
    R.SEQUENCE_GAP: Answer(409, "sequence_gap"),
    R.TXN_REFUSED: Answer(409, "txn_refused"),
    # the id's last decision is still being completed (a marker failed): retriable, like Kafka's
    # CONCURRENT_TRANSACTIONS; the clients retry 5xx
    R.CONCURRENT_TRANSACTIONS: Answer(503, "concurrent_transactions", retry_after=True),
    R.UNAVAILABLE: Answer(503, "unavailable", retry_after=True),
    R.OUTCOME_UNKNOWN: Answer(503, "outcome_unknown", retry_after=True),
    R.LIMIT: Answer(429, "limit"),
    # transactions and group offsets: answered in the stream protocol's words (a fenced epoch is a
    # stale one; a transaction that cannot go on is txn_refused); an unknown id has a code of its own,
    # so that clients do not take it for a missing stream
    R.FENCED: Answer(403, "stale_epoch"),
    R.BAD_EPOCH: Answer(400, "bad_request"),
    R.UNKNOWN_TRANSACTIONAL_ID: Answer(404, "unknown_transactional_id"),
    R.STALE_TRANSACTION: Answer(409, "txn_refused"),
    R.INVALID_STATE: Answer(409, "txn_refused"),
    R.OFFSET_REGRESSION: Answer(409, "txn_refused"),
    R.IN_USE: Answer(409, "in_use"),
    # sinks: refusals of the sink itself, not of a transaction
    R.SINK_OWNED: Answer(409, "sink_owned"),
    R.REPLAY_MISMATCH: Answer(409, "replay_mismatch"),
    # subscriptions
    R.INVALID_REQUEST: Answer(400, "INVALID_REQUEST"),
    R.WEBHOOK_URL_REJECTED: Answer(400, "WEBHOOK_URL_REJECTED"),
    R.TOKEN_INVALID: Answer(401, "TOKEN_INVALID"),
    R.NO_CONTROL_API: Answer(404, "NOT_FOUND"),
    R.SUBSCRIPTION_NOT_FOUND: Answer(404, "SUBSCRIPTION_NOT_FOUND"),
    R.SUBSCRIPTION_ALREADY_EXISTS: Answer(409, "SUBSCRIPTION_ALREADY_EXISTS"),
    R.GENERATION_FENCED: Answer(409, "FENCED"),
    R.ALREADY_CLAIMED: Answer(409, "ALREADY_CLAIMED"),
    R.NO_PENDING_WORK: Answer(409, "NO_PENDING_WORK"),
    R.INVALID_OFFSET: Answer(409, "INVALID_OFFSET"),
    R.SUBSCRIPTION_UNAVAILABLE: Answer(503, "UNAVAILABLE"),
    R.SUBSCRIPTION_OUTCOME_UNKNOWN: Answer(503, "OUTCOME_UNKNOWN", retry_after=True),
}


def answer_for(refusal: Refusal) -> Answer:
    return ANSWERS[refusal]
