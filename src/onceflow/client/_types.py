"""Results and messages: frozen, slotted dataclasses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["AppendResult", "Chunk", "Delivery", "LiveMode", "Message", "StreamInfo"]

LiveMode = Literal["long-poll", "sse"]
Delivery = Literal["at-most-once", "at-least-once", "exactly-once"]


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What HEAD says about a stream."""

    content_type: str
    next_offset: str
    closed: bool
    ttl_seconds: int | None = None
    expires_at: str | None = None


@dataclass(frozen=True, slots=True)
class AppendResult:
    """An acknowledged append. ``duplicate`` means the server already had it (a retry)."""

    next_offset: str | None
    duplicate: bool = False
    closed: bool = False
    producer_epoch: int | None = None
    producer_seq: int | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One read: the data from ``offset`` up to ``next_offset``.

    ``data`` is the raw body (a JSON array for JSON streams). ``up_to_date`` means the read reached
    the tail; ``closed`` means the stream is closed and nothing will ever follow ``next_offset``.
    """

    stream: str
    offset: str
    next_offset: str
    data: bytes
    content_type: str
    up_to_date: bool
    closed: bool
    cursor: str | None = None

    @property
    def is_json(self) -> bool:
        return self.content_type.split(";", 1)[0].strip().lower() == "application/json"

    def messages(self) -> list[Any]:
        """The messages of a JSON chunk (an empty chunk has none)."""
        if not self.data:
            return []
        value = json.loads(self.data)
        return value if isinstance(value, list) else [value]


@dataclass(frozen=True, slots=True)
class Message:
    """One message as a consumer delivers it.

    ``offset`` is where the read that returned it started and ``next_offset`` where it ended;
    ``index`` is the message's place in that read. Committing ``next_offset`` marks every message
    of the read as consumed.
    """

    stream: str
    value: Any
    offset: str
    next_offset: str
    index: int


@dataclass(frozen=True)
class Retention:
    """How much of a stream the server keeps (``Stream.create(retention=...)``): data older than
    ``seconds``, and the oldest data while the stream holds more than ``bytes``, is deleted in whole
    segments; never past the committed offset of a group in ``keep_groups``. None: the server's
    default (``onceflow serve --retention-age / --retention-bytes``). See docs/operations.md."""

    seconds: int | None = None
    bytes: int | None = None
    keep_groups: tuple[str, ...] = ()
