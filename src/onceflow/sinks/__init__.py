"""Exactly-once sinks for plain onceflow consumers: PostgreSQL, Redis, and HTTP webhooks through
an outbox. See docs/sinks.md.

The API (:class:`CheckpointAwareSink`, :class:`IdempotentSink`, :class:`TwoPhaseCommitSink`,
:class:`SinkRunner`, checkpoint stores) needs nothing beyond onceflow. The PostgreSQL sinks need
psycopg 3 and the Redis sinks redis-py: ``pip install 'onceflow[sinks]'``; they are imported on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._api import (
    Checkpoint,
    CheckpointAwareSink,
    CheckpointStore,
    FileCheckpointStore,
    IdempotentSink,
    KeyFunction,
    MemoryCheckpointStore,
    SinkError,
    SinkFencedError,
    Step,
    TwoPhaseCommitSink,
    key_function,
)
from ._outbox import OutboxSink, Webhook, WebhookRejectedError, WebhookSink, outbox_dispatcher
from ._runner import RunStats, SinkRunner

if TYPE_CHECKING:
    from .postgres import (
        PostgresInsertSink,
        PostgresTransactionalSink,
        PostgresTwoPhaseSink,
        PostgresUpsertSink,
    )
    from .redis import RedisAtomicSink, RedisIdempotentSink, RedisListSink

__all__ = [
    "Checkpoint",
    "CheckpointAwareSink",
    "CheckpointStore",
    "FileCheckpointStore",
    "IdempotentSink",
    "KeyFunction",
    "MemoryCheckpointStore",
    "OutboxSink",
    "PostgresInsertSink",
    "PostgresTransactionalSink",
    "PostgresTwoPhaseSink",
    "PostgresUpsertSink",
    "RedisAtomicSink",
    "RedisIdempotentSink",
    "RedisListSink",
    "RunStats",
    "SinkError",
    "SinkFencedError",
    "SinkRunner",
    "Step",
    "TwoPhaseCommitSink",
    "Webhook",
    "WebhookRejectedError",
    "WebhookSink",
    "key_function",
    "outbox_dispatcher",
]

_LAZY = {
    "PostgresInsertSink": (".postgres", "psycopg"),
    "PostgresTransactionalSink": (".postgres", "psycopg"),
    "PostgresTwoPhaseSink": (".postgres", "psycopg"),
    "PostgresUpsertSink": (".postgres", "psycopg"),
    "RedisAtomicSink": (".redis", "redis"),
    "RedisIdempotentSink": (".redis", "redis"),
    "RedisListSink": (".redis", "redis"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, package = _LAZY[name]
    try:
        mod = importlib.import_module(module, __name__)
    except ModuleNotFoundError as exc:
        if exc.name != package:
            raise
        raise ImportError(f"{name} needs the {package!r} package: pip install 'onceflow[sinks]'") from exc
    return getattr(mod, name)
