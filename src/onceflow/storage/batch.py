"""On-disk record batch format.

A stream's log is a sequence of record batches. One append (one HTTP POST) is one batch, so the
batch is the unit of atomicity, deduplication and checksumming. All integers are little-endian.

    offset size field
    0      4    crc         CRC32C of bytes [4, length): everything after this field
    4      4    length      total size of the batch in bytes, header included
    8      1    magic       format version, currently 0xB1
    9      1    flags       FLAG_* bits below
    10     2    reserved    zero
    12     8    base_offset record offset of the first record in the batch
    20     4    count       number of records (0 for a close-only batch)
    24     8    timestamp   milliseconds since the epoch, as appended
    32     8    epoch       producer epoch, -1 when the append carried no producer
    40     8    first_seq   producer sequence of the first record, -1 without producer
    48     8    last_seq    producer sequence of the last record, -1 without producer
    56     2    pid_len     length of the producer id that follows
    58     2    sseq_len    length of the Stream-Seq value that follows
    60     ...  producer id (UTF-8), Stream-Seq (bytes), then the payload

Payload: for byte streams the appended body as is. For JSON streams each message is stored as its
compact JSON text followed by a comma, so a read of many batches is ``[`` + payloads minus the last
comma + ``]`` with no re-encoding.

Because the producer id, epoch and sequence live in the same checksummed bytes as the data, the
producer state rebuilt from the log can never disagree with the data after a crash.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import crc32c

from ..errors import OnceflowError

__all__ = [
    "FLAG_CLOSE",
    "FLAG_COMMIT",
    "FLAG_CONTROL",
    "FLAG_JSON",
    "FLAG_TXN",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_BATCH_BYTES",
    "BatchHeader",
    "CorruptBatch",
    "encode_batch",
    "parse_header",
]

MAGIC = 0xB1
FLAG_CLOSE = 0x01  # the stream is closed after this batch
FLAG_JSON = 0x02  # payload is comma-terminated JSON texts
FLAG_TXN = 0x04  # data written inside a transaction of the batch's producer
FLAG_CONTROL = 0x08  # a transaction marker (no records): ends the producer's open transaction
FLAG_COMMIT = 0x10  # with FLAG_CONTROL: the transaction committed (without: it aborted)

HEADER = struct.Struct("<IIBBHqiqqqqHH")
HEADER_SIZE = HEADER.size  # 60
# A batch never exceeds this; a larger length field is treated as corruption.
MAX_BATCH_BYTES = 1 << 30

_LEN_AND_REST = struct.Struct("<I")


class CorruptBatch(OnceflowError):
    """The bytes at a position are not a complete, intact batch."""


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """A decoded batch header plus where its parts sit in the buffer it was parsed from."""

    length: int
    flags: int
    base_offset: int
    count: int
    timestamp: int
    epoch: int
    first_seq: int
    last_seq: int
    producer_id: str | None
    stream_seq: bytes | None
    payload_start: int  # relative to the batch start

    @property
    def closes(self) -> bool:
        return bool(self.flags & FLAG_CLOSE)


def encode_batch(
    *,
    base_offset: int,
    count: int,
    payload: bytes,
    flags: int = 0,
    producer_id: str | None = None,
    epoch: int = -1,
    first_seq: int = -1,
    last_seq: int = -1,
    stream_seq: bytes | None = None,
    timestamp: int | None = None,
) -> bytes:
    """Frame one batch; the result is what goes to disk, byte for byte."""
    pid = producer_id.encode() if producer_id is not None else b""
    sseq = stream_seq or b""
    if len(pid) > 0xFFFF or len(sseq) > 0xFFFF:
        raise ValueError("producer id or Stream-Seq longer than 65535 bytes")
    length = HEADER_SIZE + len(pid) + len(sseq) + len(payload)
    if length > MAX_BATCH_BYTES:
        raise ValueError("batch larger than 1 GiB")
    if timestamp is None:
        timestamp = int(time.time() * 1000)
    head = HEADER.pack(
        0,
        length,
        MAGIC,
        flags,
        0,
        base_offset,
        count,
        timestamp,
        epoch if producer_id is not None else -1,
        first_seq if producer_id is not None else -1,
        last_seq if producer_id is not None else -1,
        len(pid),
        len(sseq),
    )
    front = head[4:] + pid + sseq
    crc = crc32c.crc32c(payload, crc32c.crc32c(front))  # the CRC of front + payload, without joining them
    return b"".join((_LEN_AND_REST.pack(crc), front, payload))  # the payload is copied once


def parse_header(buf: bytes | memoryview, pos: int, *, verify: bool = True) -> BatchHeader:
    """Decode the batch starting at ``buf[pos]``.

    Raises CorruptBatch when the bytes are short (a torn write), the magic or a length is wrong,
    or (with ``verify``) the checksum does not match.
    """
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptBatch("truncated header")
    (crc, length, magic, flags, _res, base, count, ts, epoch, fseq, lseq, pid_len, sseq_len) = HEADER.unpack_from(
        buf, pos
    )
    if magic != MAGIC:
        raise CorruptBatch(f"bad magic {magic:#x}")
    if length < HEADER_SIZE + pid_len + sseq_len or length > MAX_BATCH_BYTES:
        raise CorruptBatch(f"bad length {length}")
    if len(buf) - pos < length:
        raise CorruptBatch("truncated batch")
    if verify and crc32c.crc32c(memoryview(buf)[pos + 4 : pos + length]) != crc:
        raise CorruptBatch("checksum mismatch")
    if count < 0:
        raise CorruptBatch("negative record count")
    p = pos + HEADER_SIZE
    pid = bytes(buf[p : p + pid_len]).decode("utf-8", "replace") if pid_len or epoch >= 0 else None
    p += pid_len
    sseq = bytes(buf[p : p + sseq_len]) if sseq_len else None
    return BatchHeader(
        length=length,
        flags=flags,
        base_offset=base,
        count=count,
        timestamp=ts,
        epoch=epoch,
        first_seq=fseq,
        last_seq=lseq,
        producer_id=pid,
        stream_seq=sseq,
        payload_start=HEADER_SIZE + pid_len + sseq_len,
    )
