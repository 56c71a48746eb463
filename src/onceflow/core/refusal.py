"""The core's one refusal vocabulary: :class:`Refusal`.

The broker (an :class:`~onceflow.core.broker.Outcome` whose ``kind`` is a ``Refusal``), the
transaction coordinator (:class:`~onceflow.core.txn.TxnError`) and the subscriptions
(:class:`~onceflow.core.subscriptions.SubscriptionError`) say why they refuse a request with a
member of this enum, and nothing else. The core knows no HTTP: ``onceflow.server.answers`` maps
every member to its status code and error code, in one table (docs/architecture.md, "The vocabulary").

A member's value is the name the core has always used for it (the stream protocol's lower-case
error codes, the coordinator's kinds, the subscription protocol's upper-case codes), so comparing a
member with that string still holds (it is a :class:`~enum.StrEnum`).
"""

from __future__ import annotations

import enum
from typing import Any

from ..errors import OnceflowError

__all__ = ["Refused", "Refusal"]


class Refusal(enum.StrEnum):
    # ---- streams (the broker)
    BAD_REQUEST = "bad_request"  # malformed: resending it unchanged fails again
    NOT_FOUND = "not_found"  # no stream by that name
    GONE = "gone"  # the stream was deleted
    OFFSET_GONE = "offset_gone"  # retention deleted the data at that offset (the earliest kept is named)
    CONFIG_CONFLICT = "config_conflict"  # a stream with another configuration holds the name
    CONTENT_TYPE_MISMATCH = "content_type_mismatch"
    STREAM_CLOSED = "stream_closed"  # closed: nothing more may be appended
    STREAM_SEQ_CONFLICT = "stream_seq_conflict"  # Stream-Seq did not increase
    TAIL_MISMATCH = "tail_mismatch"  # If-Match named a tail that is not the stream's
    STALE_EPOCH = "stale_epoch"  # a newer epoch of the producer exists (a zombie)
    INVALID_EPOCH_SEQ = "invalid_epoch_seq"  # a new epoch must start at sequence 0
    SEQUENCE_GAP = "sequence_gap"  # a producer's batch came before an earlier one
    TXN_REFUSED = "txn_refused"  # a transactional append that cannot join or commit its transaction
    CONCURRENT_TRANSACTIONS = "concurrent_transactions"  # the id's last decision is still being finished
    UNAVAILABLE = "unavailable"  # could not be done now (I/O): the same request may succeed later
    # the store could not learn whether the write happened (its answer was lost, then the store was
    # lost too): it may be served later, or not; a retry with the same producer headers tells which
    OUTCOME_UNKNOWN = "outcome_unknown"
    LIMIT = "limit"  # a server limit (the stream cap) is reached
    # ---- transactions, group offsets and sinks (the coordinator)
    FENCED = "fenced"  # an older epoch (producer or group member) than the current one
    BAD_EPOCH = "bad_epoch"  # an epoch that was never issued
    UNKNOWN_TRANSACTIONAL_ID = "unknown_transactional_id"  # never initialised
    STALE_TRANSACTION = "stale_transaction"  # names a transaction other than the current one
    INVALID_STATE = "invalid_state"  # the transaction already ended otherwise
    OFFSET_REGRESSION = "offset_regression"  # group offsets would move backwards
    IN_USE = "in_use"  # a group or transactional id cannot be deleted while a transaction holds it
    SINK_OWNED = "sink_owned"  # the sink belongs to another query
    REPLAY_MISMATCH = "replay_mismatch"  # a replayed batch carries other rows than its commit did
    # ---- subscriptions (the Durable Streams subscription protocol's codes)
    INVALID_REQUEST = "INVALID_REQUEST"
    NO_CONTROL_API = "NOT_FOUND"  # no control route at that path
    SUBSCRIPTION_NOT_FOUND = "SUBSCRIPTION_NOT_FOUND"
    SUBSCRIPTION_ALREADY_EXISTS = "SUBSCRIPTION_ALREADY_EXISTS"
    WEBHOOK_URL_REJECTED = "WEBHOOK_URL_REJECTED"
    TOKEN_INVALID = "TOKEN_INVALID"  # noqa: S105 (an error code, not a secret)
    GENERATION_FENCED = "FENCED"  # a callback or ack of an earlier wake generation
    ALREADY_CLAIMED = "ALREADY_CLAIMED"
    NO_PENDING_WORK = "NO_PENDING_WORK"
    INVALID_OFFSET = "INVALID_OFFSET"
    SUBSCRIPTION_UNAVAILABLE = "UNAVAILABLE"  # the subscription state could not be stored or signed
    SUBSCRIPTION_OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # whether its state was stored is not known

    @property
    def retriable(self) -> bool:
        """Whether the same request may succeed later, unchanged."""
        return self in _RETRIABLE


_RETRIABLE = frozenset(
    {
        Refusal.UNAVAILABLE,
        Refusal.OUTCOME_UNKNOWN,
        Refusal.CONCURRENT_TRANSACTIONS,
        Refusal.LIMIT,
        Refusal.SUBSCRIPTION_UNAVAILABLE,
        Refusal.SUBSCRIPTION_OUTCOME_UNKNOWN,
    }
)


class Refused(OnceflowError):
    """A request the core refuses: ``refusal`` says why, ``extra`` carries what the answer
    reports besides (an epoch, a transaction number, a generation...). ``code`` is the refusal's
    name and ``retriable`` the refusal's."""

    def __init__(self, refusal: Refusal, message: str, **extra: Any) -> None:
        super().__init__(message, code=refusal.value, retriable=refusal.retriable)
        self.refusal = refusal
        self.extra = extra
