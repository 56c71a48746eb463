"""Raw HTTP/1.1 over loopback sockets for tests: read responses strictly, so that a framing error fails.

A response is well-framed when its status line is ``HTTP/1.1 NNN reason``, every header line is
``name: value``, and its body is delimited by ``Content-Length`` or ``Transfer-Encoding: chunked``
(or is empty: 1xx, 204, 304, or the answer to a HEAD). ``read_response`` raises ``Malformed`` for
anything else, and returns ``None`` when the server closed the connection cleanly between responses.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

__all__ = ["WAIT", "Malformed", "Response", "closed_within", "connect", "read_response"]

WAIT = 10.0  # the upper bound of anything a test waits for; never a timing assertion
_STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")
_HEADER = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+): ?([^\r\n]*)\r\n")


class Malformed(AssertionError):
    """The server wrote bytes that are not a well-framed HTTP/1.1 response."""


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    interim: list[int] = field(default_factory=list)  # 1xx statuses received before this response

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        return values[-1] if values else None

    @property
    def closes(self) -> bool:
        return (self.header("connection") or "").lower() == "close"


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, limit=1 << 20), WAIT)


async def _line(reader: asyncio.StreamReader) -> bytes:
    line = await asyncio.wait_for(reader.readline(), WAIT)
    if line and not line.endswith(b"\r\n"):
        raise Malformed(f"line not ended by CRLF: {line[:200]!r}")
    return line


async def _head(reader: asyncio.StreamReader) -> tuple[int, list[tuple[str, str]]] | None:
    first = await _line(reader)
    if not first:
        return None
    m = _STATUS.fullmatch(first)
    if m is None:
        raise Malformed(f"bad status line {first[:200]!r}")
    headers: list[tuple[str, str]] = []
    while (line := await _line(reader)) != b"\r\n":
        h = _HEADER.fullmatch(line)
        if h is None:
            raise Malformed(f"bad header line {line[:200]!r}")
        headers.append((h.group(1).decode().lower(), h.group(2).decode("latin-1")))
    return int(m.group(1)), headers


async def read_response(reader: asyncio.StreamReader, *, head: bool = False) -> Response | None:
    """The next final response (1xx responses before it are collected in ``interim``)."""
    interim: list[int] = []
    while True:
        parsed = await _head(reader)
        if parsed is None:
            if interim:
                raise Malformed(f"connection closed after interim responses {interim}")
            return None
        status, headers = parsed
        if 100 <= status < 200:
            if any(k in ("content-length", "transfer-encoding") for k, _ in headers):
                raise Malformed(f"{status} with a body: {headers}")
            interim.append(status)
            continue
        break
    names = [k for k, _ in headers]
    lengths = [v for k, v in headers if k == "content-length"]
    chunked = [v for k, v in headers if k == "transfer-encoding"]
    if len(lengths) > 1 or (lengths and chunked):
        raise Malformed(f"ambiguous framing: {headers}")
    if chunked and chunked != ["chunked"]:
        raise Malformed(f"transfer-encoding {chunked}")
    body = b""
    if head or status in (204, 304):
        if chunked and status in (204, 304):
            raise Malformed(f"{status} declared a chunked body")
    elif lengths:
        if not lengths[0].isdigit():
            raise Malformed(f"content-length {lengths[0]!r}")
        body = await asyncio.wait_for(reader.readexactly(int(lengths[0])), WAIT)
    elif chunked:
        parts = []
        while True:
            size_line = await _line(reader)
            if not re.fullmatch(rb"[0-9a-f]+\r\n", size_line):
                raise Malformed(f"bad chunk size line {size_line[:100]!r}")
            size = int(size_line[:-2], 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), WAIT)
            if chunk[-2:] != b"\r\n":
                raise Malformed("chunk not followed by CRLF")
            if size == 0:
                break
            parts.append(chunk[:-2])
        body = b"".join(parts)
    elif "connection" not in names:
        raise Malformed(f"no framing for a {status} body: {headers}")
    else:
        body = await asyncio.wait_for(reader.read(), WAIT)
    return Response(status, headers, body, interim)


async def closed_within(reader: asyncio.StreamReader, seconds: float = WAIT) -> bytes:
    """Everything the server sends until it closes; fails when it has not closed after ``seconds``."""
    data = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(f"the server kept the connection open for {seconds:g} s (got {data[:200]!r})")
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
