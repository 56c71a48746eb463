"""Constants and framing of onceflow's wire format shared by the server, the clients and the tools.

A leaf module: it imports nothing from onceflow, so every layer may import it (docs/architecture.md).

- :data:`MAX_SAFE_INT`: the largest integer a header or query parameter may carry (2**53 - 1, the
  largest integer a JavaScript client can represent exactly; the Durable Streams protocol's bound).
- :data:`RECORDS_MEDIA_TYPE` and :data:`FRAME`: a ``format=records`` read (docs/protocol.md) answers
  frames, one per appended batch: a little-endian header (first record offset ``q``, record count
  ``I``, append time in ms ``q``, payload length ``I``) and then the payload.
  :func:`iter_frames` splits such a body.
- :data:`CODINGS` and :func:`compress`: the content codings a body may travel in, both ways
  (``Content-Encoding`` on appends, ``Accept-Encoding`` on reads; docs/protocol.md,
  "Compression"), and how onceflow compresses a body, the same in the server and the clients.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import Literal, NamedTuple

import zstandard

__all__ = [
    "CODINGS",
    "COMPRESS_MIN",
    "FRAME",
    "MAX_SAFE_INT",
    "RECORDS_MEDIA_TYPE",
    "Coding",
    "RecordsFrame",
    "compress",
    "iter_frames",
]

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


Coding = Literal["gzip", "zstd"]
CODINGS: tuple[Coding, ...] = ("gzip", "zstd")
# Below this many bytes a body goes as it is: a gzip member's header and trailer alone are 18 bytes,
# and JSON messages of a few hundred bytes shrink by a third at most (docs/benchmarks.md).
COMPRESS_MIN = 1024
# Level 1 of both: on JSON messages it keeps most of the gain of the default levels (gzip 6: 0.15
# of the size where level 1 gives 0.20; zstd 3 gives 0.16 where 1 gives 0.15) at two to four times
# the speed, and compressing is work on the event loop's thread of a server or a producer.
_GZIP_LEVEL = 1
_ZSTD_LEVEL = 1


def compress(body: bytes, coding: Coding) -> bytes:
    """``body`` in content coding ``coding``: one gzip member (RFC 1952) or one zstd frame (RFC 8878)
    with its content size and a checksum, whose window, that of level 1 (512 KiB), is well
    under the 8 MiB a decoder of the ``zstd`` content coding must accept (RFC 9659)."""
    if coding == "gzip":
        packer = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        return packer.compress(body) + packer.flush()
    if coding == "zstd":
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True).compress(body)
    raise ValueError(f"unknown content coding {coding!r}: onceflow compresses with {' or '.join(CODINGS)}")
