"""The onceflow Python client: streams, idempotent and transactional producers, topics and consumers,
sync and asyncio.

Works with any Durable Streams server; prefix subscriptions use onceflow's ``/v1/streams`` listing.
"""

from ._errors import (
    AbortRequiredError,
    BadRequestError,
    CommitOutcomeUnknownError,
    ConflictError,
    ContentTypeMismatchError,
    ForbiddenError,
    OffsetGoneError,
    OnceflowError,
    OutcomeUnknownError,
    PayloadTooLargeError,
    PreconditionFailedError,
    ProducerFencedError,
    SequenceGapError,
    ServerError,
    StreamClosedError,
    StreamGoneError,
    StreamNotFoundError,
    TransportError,
    UnknownTransactionalIdError,
)
from ._types import AppendResult, Chunk, Delivery, LiveMode, Message, Retention, StreamInfo
from .consumer import AsyncConsumer, AsyncOffsetStore, Consumer, FileOffsetStore, MemoryOffsetStore, OffsetStore
from .producer import AsyncIdempotentProducer, IdempotentProducer, ProducerStats
from .stream import AsyncStream, Stream
from .topic import TopicProducer, partition_for, partition_names
from .transactions import AsyncTransactionalProducer, GroupOffsetStore, TransactionalProducer

__all__ = [
    "AbortRequiredError",
    "AppendResult",
    "AsyncConsumer",
    "AsyncIdempotentProducer",
    "AsyncOffsetStore",
    "AsyncStream",
    "AsyncTransactionalProducer",
    "BadRequestError",
    "Chunk",
    "CommitOutcomeUnknownError",
    "ConflictError",
    "Consumer",
    "ContentTypeMismatchError",
    "ForbiddenError",
    "Delivery",
    "FileOffsetStore",
    "GroupOffsetStore",
    "IdempotentProducer",
    "LiveMode",
    "MemoryOffsetStore",
    "Message",
    "OffsetGoneError",
    "OffsetStore",
    "OnceflowError",
    "OutcomeUnknownError",
    "PayloadTooLargeError",
    "PreconditionFailedError",
    "ProducerFencedError",
    "ProducerStats",
    "Retention",
    "SequenceGapError",
    "ServerError",
    "Stream",
    "StreamClosedError",
    "StreamGoneError",
    "StreamInfo",
    "StreamNotFoundError",
    "TopicProducer",
    "TransactionalProducer",
    "TransportError",
    "UnknownTransactionalIdError",
    "partition_for",
    "partition_names",
]
