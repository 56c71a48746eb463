"""Compressed bodies: the ``Content-Encoding`` of appends and the ``Accept-Encoding`` of reads.

The codings are :data:`~onceflow.wire.CODINGS` (gzip and zstd); docs/protocol.md, "Compression",
says what a client sees. This module knows no routes: it parses the two headers and decodes a body
within a bound; server/app.py decides where a coded body is taken and maps the errors to answers.

Decoding is bounded by the *decoded* size (:class:`BodyDecoder`): a body of a few kilobytes that
inflates to gigabytes (a zip bomb) is stopped one byte past the bound, having held no more than
that, and is answered ``413`` by the app. A body that is not what its coding says (corrupt,
truncated, followed by bytes that are no member or frame) is :class:`Malformed`.
"""

from __future__ import annotations

import zlib
from typing import IO, cast

import zstandard

from ..errors import OnceflowError
from ..wire import CODINGS, Coding

__all__ = [
    "BodyDecoder",
    "DecodedTooLarge",
    "Malformed",
    "UnsupportedCoding",
    "accepted_coding",
    "content_coding",
]

# the names a coding is known by in headers: x-gzip is gzip (RFC 9110 8.4.1.3)
_NAMES: dict[str, Coding] = {"gzip": "gzip", "x-gzip": "gzip", "zstd": "zstd"}
# the server's choice among codings a client accepts equally: zstd compresses JSON as well as gzip's
# default level at several times the speed of gzip's fastest (docs/benchmarks.md)
_PREFERENCE: tuple[Coding, ...] = ("zstd", "gzip")
_SLICE = 1 << 20  # decoded bytes made by one call of the inflater
# the largest window a zstd frame may need: what a decoder of the zstd content coding must accept
# (RFC 9659), and no more, as the decoder allocates it for each frame
_ZSTD_WINDOW = 8 << 20
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # skippable frames: this with any low nibble


class UnsupportedCoding(OnceflowError):
    """A ``Content-Encoding`` this server does not decode (the app answers ``415``)."""


class Malformed(OnceflowError):
    """A body that is not valid in its content coding (the app answers ``400``)."""


class DecodedTooLarge(OnceflowError):
    """A body that decodes to more than the limit (the app answers ``413``)."""


def content_coding(value: str | None) -> Coding | None:
    """The coding a request's ``Content-Encoding`` names; None for none (or ``identity``).

    One coding only: a body coded twice (``gzip, zstd``) is refused as an unknown coding would be,
    as nothing sends one and each layer would be another bound to keep."""
    if value is None:
        return None
    codings = [c.strip().lower() for c in value.split(",") if c.strip() and c.strip().lower() != "identity"]
    if not codings:
        return None
    supported = ", ".join(CODINGS)
    if len(codings) > 1:
        raise UnsupportedCoding(
            f"Content-Encoding {value!r} names {len(codings)} codings; this server decodes one of {supported}"
        )
    coding = _NAMES.get(codings[0])
    if coding is None:
        raise UnsupportedCoding(
            f"Content-Encoding {codings[0]!r} is not supported: send the body as it is, or in one of {supported}"
        )
    return coding


def accepted_coding(value: str | None) -> Coding | None:
    """The coding to answer a read in, of those ``Accept-Encoding`` accepts (RFC 9110 12.5.3):
    the one with the highest ``q``, zstd where they tie; ``*`` stands for any coding not named;
    None when the header is absent, accepts neither, or names ``identity`` with a higher ``q``
    (``identity`` is always acceptable here).

    An absent header would allow any coding by the RFC's letter; it gets none, as clients that
    decode codings say so and those that do not (``curl`` without ``--compressed``) send nothing."""
    if not value:
        return None
    weights: dict[str, float] = {}
    for item in value.split(","):
        name, *params = item.split(";")
        key = name.strip().lower()
        if not key:
            continue
        weight = 1.0
        for param in params:
            pname, _, pvalue = param.partition("=")
            if pname.strip().lower() == "q":
                try:
                    weight = float(pvalue.strip())
                except ValueError:
                    weight = 0.0  # a q that is no number accepts nothing
        weights[key] = weight
    star = weights.get("*", 0.0)
    best: Coding | None = None
    best_weight = 0.0
    for coding in _PREFERENCE:
        named = [w for n, w in weights.items() if _NAMES.get(n) == coding]
        weight = max(named) if named else star
        if weight > best_weight:
            best, best_weight = coding, weight
    if weights.get("identity", 0.0) > best_weight:
        return None  # the client prefers the body as it is (identity;q=1, gzip;q=0.5)
    return best


class _ZstdFrames:
    """Follows the frame and block headers of a zstd body as it comes, to tell whether its last
    frame is complete: the decoder says nothing of a body cut off after any whole block.

    Frame layout (RFC 8878 3.1.1): a magic number, a frame header (its first byte says how long
    the rest is), blocks with a 3-byte header each (last-block flag, type, size), and a 4-byte
    checksum when the header asks for one. Skippable frames carry their length. Only the headers
    are looked at, a few bytes in each block of up to 128 KiB."""

    def __init__(self) -> None:
        self._state = "magic"
        self._want = 4  # header bytes to collect next
        self._head = bytearray()
        self._skip = 0  # bytes to pass over before the next header
        self._checksum = False

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                step = min(self._skip, n - i)
                self._skip -= step
                i += step
                continue
            take = min(self._want - len(self._head), n - i)
            self._head += data[i : i + take]
            i += take
            if len(self._head) == self._want:
                head = bytes(self._head)
                self._head.clear()
                self._step(head)

    def _step(self, head: bytes) -> None:
        value = int.from_bytes(head, "little")
        if self._state == "magic":
            if value == _ZSTD_MAGIC:
                self._state, self._want = "frame", 1
            elif value & 0xFFFFFFF0 == _SKIPPABLE:
                self._state, self._want = "skippable", 4
            else:
                raise Malformed("the body is not valid zstd: no zstd frame begins where one should")
        elif self._state == "skippable":
            self._state, self._want, self._skip = "magic", 4, value
        elif self._state == "frame":
            single_segment = value >> 5 & 1
            content_size = (1 if single_segment else 0, 2, 4, 8)[value >> 6]
            dictionary = (0, 1, 2, 4)[value & 3]
            self._checksum = bool(value >> 2 & 1)
            self._state, self._want, self._skip = "block", 3, (0 if single_segment else 1) + dictionary + content_size
        else:  # a block header
            kind, size = value >> 1 & 3, value >> 3
            if kind == 3:
                raise Malformed("the body is not valid zstd: a block of the reserved type")
            self._skip = 1 if kind == 1 else size  # an RLE block holds one byte
            if value & 1:  # the frame's last block
                self._skip += 4 if self._checksum else 0
                self._state, self._want = "magic", 4

    def complete(self) -> bool:
        """Whether the body so far ends where a frame ends."""
        return self._state == "magic" and not self._head and not self._skip


class _Sink:
    """Where the zstd decoder writes: pieces kept until the limit is passed (a file to the decoder,
    which calls only ``write``)."""

    def __init__(self, decoder: BodyDecoder) -> None:
        self.decoder = decoder

    def write(self, data: bytes) -> int:
        self.decoder._add(bytes(data))
        return len(data)


class BodyDecoder:
    """Decodes a request body in ``coding`` given piece by piece (:meth:`feed`), keeping at most
    ``limit`` decoded bytes: past that :class:`DecodedTooLarge`, with nothing more decoded.
    :meth:`end` says whether the body was complete and gives it decoded.

    gzip: one member or several in a row (RFC 1952 2.2), inflated as the pieces come, ``_SLICE``
    bytes at a time: a bomb is stopped before the rest of it is received. An inflater holds its
    32 KiB window between pieces, as little as the HTTP layer holds for a connection.

    zstd: one frame or several (skippable ones too), each needing a window of at most 8 MiB
    (RFC 9659), which the decoder allocates as it reads a frame's header. Decoded as the pieces
    came would hold a window per request whose body is still coming: a thousand connections that
    each sent a frame header and trickle the rest would hold gigabytes for a few bytes each. So
    the pieces are kept as sent (bounded as sent by the app, as a plain body is) while only their
    frame headers are followed (:class:`_ZstdFrames`: a body that is no zstd is refused at once),
    and decoded in :meth:`end`, at one go, without a pause for the event loop: one window at a
    time in the process. The decoder writes its output in pieces of ``_SLICE`` to :class:`_Sink`,
    which counts them.

    An empty body is empty in any coding (a close with ``Stream-Closed`` has none)."""

    def __init__(self, coding: Coding, limit: int) -> None:
        self.coding = coding
        self.limit = limit
        self.size = 0
        self._pieces: list[bytes] = []
        self._open = False  # a gzip member began and has not ended
        self._inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._frames = _ZstdFrames()
        self._coded: list[bytes] = []  # zstd: the pieces as sent, decoded in end()

    def _add(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size > self.limit:
            raise DecodedTooLarge(f"the request body decodes to more than the server's limit of {self.limit} bytes")
        if piece:
            self._pieces.append(piece)

    def feed(self, data: bytes) -> None:
        """Decode the next piece of the body."""
        if not data:
            return
        if self.coding == "zstd":
            self._frames.feed(data)
            self._coded.append(data)
            return
        inflater = self._inflater
        self._open = True
        while True:
            room = min(_SLICE, self.limit - self.size + 1)  # one byte past the limit tells it is passed
            try:
                out = inflater.decompress(data, room)
            except zlib.error as exc:
                raise Malformed(f"the body is not valid gzip: {exc}") from None
            self._add(out)
            if inflater.eof:  # a member ended: what follows must be another one
                data = inflater.unused_data
                self._inflater = inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._open = bool(data)
                if not data:
                    return
                continue
            data = inflater.unconsumed_tail
            if not data and len(out) < room:
                return  # all taken in, and nothing held back: the rest of the member is still to come

    def end(self) -> bytes:
        """The whole body decoded; :class:`Malformed` when it stops inside a member or frame."""
        if self._open or not self._frames.complete():
            raise Malformed(f"the body is not valid {self.coding}: it ends before its last {self._unit} does")
        if self._coded:
            coded, self._coded = self._coded, []
            writer = zstandard.ZstdDecompressor(max_window_size=_ZSTD_WINDOW).stream_writer(
                cast(IO[bytes], _Sink(self)), write_size=_SLICE, write_return_read=True, closefd=False
            )
            try:
                for piece in coded:
                    writer.write(piece)
            except zstandard.ZstdError as exc:
                raise Malformed(f"the body is not valid zstd: {exc}") from None
        pieces = self._pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    @property
    def _unit(self) -> str:
        return "frame" if self.coding == "zstd" else "member"
