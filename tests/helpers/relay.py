"""A TCP relay that can *freeze*: it stops passing bytes either way but keeps every connection
open, as a network partition does (no reset, no error: reads just wait). Put it between a server
and its database to make that server's database calls hang while other servers reach the
database directly. With ``record``, it keeps what passed each way (``heard``), for a test to look
at the bytes on the wire."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["FreezableRelay"]


class FreezableRelay:
    """Relays ``127.0.0.1:port`` (:attr:`port`) to ``upstream``; :meth:`freeze` partitions it.
    ``heard["up"]`` and ``heard["down"]``: what went to ``upstream`` and back, kept with ``record``."""

    def __init__(self, upstream: tuple[str, int], *, record: bool = False) -> None:
        self.upstream = upstream
        self.record = record
        self.heard = {"up": bytearray(), "down": bytearray()}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()  # set: bytes pass
        self._open.set()
        self._stopped = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._open.clear()

    def stop(self) -> None:
        self._stopped = True
        self._open.set()
        with self._lock:
            for s in [self._listener, *self._sockets]:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            for src, dst, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, way), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        with contextlib.suppress(OSError):
            while True:
                self._open.wait()
                data = src.recv(1 << 16)
                if not data:
                    break
                self._open.wait()  # frozen while this was on its way: held, never delivered
                if self._stopped:
                    break
                if self.record:
                    with self._lock:
                        self.heard[way] += data
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
