"""A live SSE read of a server that falls silent (frozen: SIGSTOP, a paused VM; its kernel keeps
the connection open) is given up on, instead of waiting forever (issue 30, item 7).

The server sends a keep-alive control event every ``--long-poll-timeout`` (20 s by default) while
a stream is idle, so a read that hears nothing for :data:`~onceflow.client.stream.SSE_SILENCE`
seconds is talking to a server that is gone. A socket server here answers the SSE request with
its headers and one event, then says nothing more."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

import onceflow.client.stream as stream_module
from onceflow.client import AsyncStream, Stream
from onceflow.client._errors import TransportError

EVENT = (
    b"event: data\ndata: [1]\n\n"
    b'event: control\ndata: {"streamNextOffset":"0000000000000001_0000000000000003","upToDate":true}\n\n'
)


@pytest.fixture
def frozen() -> Iterator[str]:
    """A server that answers HEAD (the stream's content type) and starts an SSE answer, then is
    silent; its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        while not stop.is_set():
            try:
                request = conn.recv(65536)
            except OSError:
                return
            if not request:
                return
            if request.startswith(b"HEAD"):
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"stream-next-offset: 0000000000000001_0000000000000003\r\ncontent-length: 0\r\n\r\n"
                )
                continue
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + f"{len(EVENT):x}\r\n".encode()
                + EVENT
                + b"\r\n"
            )  # and then nothing, ever

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join()
        for c in held:
            c.close()
        listener.close()


def test_a_live_sse_read_gives_up_on_a_silent_server(frozen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_module, "SSE_SILENCE", 0.5)
    got: list[object] = []
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            with Stream(f"{frozen}/v1/stream/s") as s:
                for m in s.messages(live="sse"):
                    got.append(m)
        except BaseException as exc:  # noqa: BLE001 - what the reader ends with is the point
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert not reader.is_alive(), "the SSE read still waits on a server that stopped talking"
    assert got == [1]
    assert len(outcome) == 1 and isinstance(outcome[0], TransportError), outcome


@pytest.mark.anyio
async def test_an_async_live_sse_read_gives_up_on_a_silent_server(frozen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_module, "SSE_SILENCE", 0.5)
    got: list[object] = []

    async def read() -> None:
        async with AsyncStream(f"{frozen}/v1/stream/s") as s:
            async for m in s.messages(live="sse"):
                got.append(m)

    with pytest.raises(TransportError):
        await asyncio.wait_for(read(), timeout=20)
    assert got == [1]
