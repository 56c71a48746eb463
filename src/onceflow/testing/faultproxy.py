"""A small fault-injecting HTTP/1.1 proxy (tests, `onceflow demo`, chaos runs): lost acknowledgements, delays, reordering.

The proxy listens on a free loopback port and forwards every request to one upstream server
(``127.0.0.1:<port>``). It runs its own asyncio event loop in a background thread, so it works
for blocking and asyncio clients alike::

    proxy = FaultProxy(server.port, drop_probability=0.3, seed=7)
    proxy.start()
    try:
        ...  # point the client at proxy.url
    finally:
        proxy.stop()

Faults apply only to requests whose method is in ``methods`` (default: ``POST``) and, when
``paths`` is given, whose request target contains one of its strings (``paths=("/commit",)``);
``max_faults`` (default: no limit) caps how many responses are dropped or delayed in all, so a
test can lose exactly the first answer to a request and let its retry through:

- **drop** (a "lost ack"): the request is forwarded, the whole response is read from the server
  (so the server has processed and committed it), and then the client connection is closed without
  a byte of the response. Chosen deterministically (``drop_every=N``: every Nth matching request)
  and/or at random (``drop_probability``, from a seeded RNG).
- **delay**: the response is held ``delay`` seconds (plus up to ``delay_jitter``) before it is sent.
- **request_jitter**: the request is held a random 0..``request_jitter`` seconds before it is
  forwarded, so concurrent requests can reach the server in another order than they were sent.

Framing: requests must carry ``Content-Length`` (or no body); responses may use
``Content-Length``, chunked encoding, no body (204/304/HEAD) or close-delimited bodies. A response
is buffered whole before it is relayed, so endless streaming responses (SSE, long reads) are not
supported: read the server directly for those. Client connections are kept alive; each has its own
upstream connection. The knobs are plain attributes and may be changed while the proxy runs.
``forwarded_producer_seqs`` records the (Producer-Epoch, Producer-Seq) of matching requests in the
order they went upstream, so a test can check that reordering really happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Iterable

__all__ = ["FaultProxy"]

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024


class _Closed(Exception):
    """The peer closed the connection cleanly between messages."""


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(_HEAD_END)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise _Closed from None
        raise


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """The start line and the headers (lower-cased names; repeated headers joined by ', ')."""
    lines = head[: -len(_HEAD_END)].decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line {line!r}")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return lines[0], headers


def _has_token(value: str | None, token: str) -> bool:
    return value is not None and token in {t.strip().lower() for t in value.split(",")}


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, raw (size lines, data, trailers), ready to relay as it was."""
    out = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        out += line
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:  # trailers, up to an empty line
                trailer = await reader.readuntil(b"\r\n")
                out += trailer
                if trailer == b"\r\n":
                    return bytes(out)
        out += await reader.readexactly(size + 2)


class FaultProxy:
    """See the module docstring. ``port``/``url`` are valid after :meth:`start`."""

    def __init__(
        self,
        upstream_port: int,
        *,
        upstream_host: str = "127.0.0.1",
        drop_probability: float = 0.0,
        drop_every: int = 0,
        delay: float = 0.0,
        delay_jitter: float = 0.0,
        request_jitter: float = 0.0,
        methods: Iterable[str] = ("POST",),
        paths: Iterable[str] = (),
        max_faults: int | None = None,
        seed: int | None = 0,
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.drop_probability = drop_probability
        self.drop_every = drop_every
        self.delay = delay
        self.delay_jitter = delay_jitter
        self.request_jitter = request_jitter
        self.methods = {m.upper() for m in methods}
        self.paths = tuple(paths)  # empty: any target
        self.max_faults = max_faults  # None: no limit
        self._rng = random.Random(seed)  # noqa: S311 - fault schedule, not security
        self.port = 0
        # counters (written by the proxy thread only)
        self.connections = 0  # client connections accepted
        self.requests_forwarded = 0  # requests sent upstream (any method)
        self.matched = 0  # of those, requests the faults apply to
        self.responses_dropped = 0  # responses read from the server and never relayed
        self.responses_delayed = 0
        self.upstream_errors = 0  # upstream closed/refused before a complete response
        # (producer-epoch, producer-seq) of each matching request, in the order it was sent upstream
        self.forwarded_producer_seqs: list[tuple[int, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stop_event: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> None:
        """Listen on ``127.0.0.1:port`` (0: a free port) and serve from a background thread."""
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        self._ready.clear()
        self._startup_error = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(port,), name="faultproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start within 10 s")
        if self._startup_error is not None:
            self._thread.join(10)
            self._thread = None
            raise RuntimeError(f"fault proxy could not listen: {self._startup_error!r}") from self._startup_error

    def stop(self) -> None:
        """Close the listener and every connection, stop the loop, join the thread. Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if thread.is_alive() and self._stop_event is not None:
            with contextlib.suppress(RuntimeError):  # the loop already finished
                loop.call_soon_threadsafe(self._stop_event.set)
        thread.join(15)
        if thread.is_alive():
            raise RuntimeError("fault proxy thread did not stop")
        self._thread = None

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, port: int) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(port))
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                self._ready.set()  # in case _main failed before setting it

    async def _main(self, port: int) -> None:
        self._stop_event = asyncio.Event()
        try:
            server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        except OSError as exc:
            self._startup_error = exc
            self._ready.set()
            return
        self.port = int(server.sockets[0].getsockname()[1])
        self._ready.set()
        try:
            await self._stop_event.wait()
        finally:
            server.close()
            for t in list(self._tasks):
                t.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            for w in list(self._writers):  # connections accepted but never handled
                w.close()
            await server.wait_closed()

    # ------------------------------------------------------------------ relaying

    def _should_drop(self, ordinal: int) -> bool:
        """Whether to drop the response of the ``ordinal``-th matching request (1-based)."""
        if self.drop_every > 0 and ordinal % self.drop_every == 0:
            return True
        return self.drop_probability > 0 and self._rng.random() < self.drop_probability

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await _read_head(reader)
                except _Closed:
                    return
                start_line, headers = _parse_head(head)
                method = start_line.split(" ", 1)[0].upper()
                if _has_token(headers.get("transfer-encoding"), "chunked"):
                    return  # not needed by the tests: refuse by closing
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                client_close = _has_token(headers.get("connection"), "close")
                target = start_line.split(" ", 2)[1] if start_line.count(" ") >= 1 else ""
                faulty = method in self.methods and (not self.paths or any(p in target for p in self.paths))
                if faulty and self.request_jitter > 0:
                    await asyncio.sleep(self._rng.uniform(0, self.request_jitter))

                if upstream is None:
                    try:
                        upstream = await asyncio.open_connection(self.upstream_host, self.upstream_port)
                    except OSError:
                        self.upstream_errors += 1
                        return  # the client sees a dropped connection, as with a dead server
                up_reader, up_writer = upstream
                up_writer.write(head + body)
                await up_writer.drain()
                self.requests_forwarded += 1
                ordinal = 0
                if faulty:
                    self.matched += 1
                    ordinal = self.matched
                    epoch, seq = headers.get("producer-epoch", ""), headers.get("producer-seq", "")
                    if epoch.isdigit() and seq.isdigit():
                        self.forwarded_producer_seqs.append((int(epoch), int(seq)))

                try:
                    resp_head = await _read_head(up_reader)
                    status_line, resp_headers = _parse_head(resp_head)
                    status = int(status_line.split(" ", 2)[1])
                    keep_alive = not _has_token(resp_headers.get("connection"), "close")
                    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                        resp_body = b""
                    elif _has_token(resp_headers.get("transfer-encoding"), "chunked"):
                        resp_body = await _read_chunked(up_reader)
                    elif "content-length" in resp_headers:
                        resp_body = await up_reader.readexactly(int(resp_headers["content-length"]))
                    else:
                        resp_body = await up_reader.read()  # delimited by the server closing
                        keep_alive = False
                except (_Closed, asyncio.IncompleteReadError, ConnectionError):
                    self.upstream_errors += 1
                    return  # relay the failure as it was: the connection just ends

                if faulty and self.max_faults is not None:  # no await between this check and the count
                    faulty = self.responses_dropped + self.responses_delayed < self.max_faults
                if faulty and self._should_drop(ordinal):
                    self.responses_dropped += 1
                    return  # the server committed it; the client never hears back
                if faulty and (self.delay > 0 or self.delay_jitter > 0):
                    self.responses_delayed += 1
                    await asyncio.sleep(self.delay + self._rng.uniform(0, self.delay_jitter))
                writer.write(resp_head + resp_body)
                await writer.drain()
                if not keep_alive:
                    return
                if client_close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return  # a broken or malformed connection: just close it
        except asyncio.CancelledError:
            return  # the proxy is stopping (asyncio would log a cancelled connection handler)
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            for w in (writer, upstream[1] if upstream is not None else None):
                if w is None:
                    continue
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
