"""Constants and framing of onceflow's wire format shared by the server, the clients and the tools.

A leaf module: it imports nothing from onceflow, so every layer may import it (docs/architecture.md).

- :data:`MAX_SAFE_INT`: the largest integer a header or query parameter may carry (2**53 - 1, the
  largest integer a JavaScript client can represent exactly; the Durable Streams protocol's bound).
- :data:`RECORDS_MEDIA_TYPE` and :data:`FRAME`: a ``format=records`` read (docs/protocol.md) answers
  frames, one per appended batch: a little-endian header (first record offset ``q``, record count
  ``I``, append time in ms ``q``, payload length ``I``) and then the payload.
  :func:`iter_frames` splits such a body.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["FRAME", "MAX_SAFE_INT", "RECORDS_MEDIA_TYPE", "RecordsFrame", "iter_frames"]

MAX_SAFE_INT = 2**53 - 1
RECORDS_MEDIA_TYPE = b"application/vnd.onceflow.records"
# format=records frame header: first record offset, record count, append time (ms), payload length
FRAME = struct.Struct("<qIqI")


class RecordsFrame(NamedTuple):
    """One appended batch of a ``format=records`` read."""

    base_offset: int
    record_count: int
    timestamp_ms: int
    payload: bytes


def iter_frames(body: bytes) -> Iterator[RecordsFrame]:
    """The frames of a ``format=records`` response body, in order."""
    p = 0
    while p < len(body):
        base, count, ts, size = FRAME.unpack_from(body, p)
        p += FRAME.size
        yield RecordsFrame(base, count, ts, body[p : p + size])
        p += size
