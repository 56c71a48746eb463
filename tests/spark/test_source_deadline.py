"""The source's requests follow ``requestTimeoutSeconds``, as the sink's do (issue 30, item 11).

The source's connection waited a fixed 30 s for each answer: an answer lost on a connection that
stays open (a frozen server, a proxy holding it) used up any deadline under 30 s in one attempt,
and the job failed where a retry on a fresh connection would have gone on. Each attempt now waits
a quarter of the deadline (at most 30 s), so several fit in it. A socket server here accepts
every connection and never answers; the attempts it sees are counted (no Spark session needed)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from onceflow.client import OnceflowError
from onceflow.spark.options import Options

pytest.importorskip("pyspark", reason="pyspark is part of the dev install (scripts/setup.sh dev)")


@pytest.fixture
def silent() -> Iterator[tuple[str, list[socket.socket]]]:
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)  # read nothing, answer nothing

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join()
        for c in accepted:
            c.close()
        listener.close()


def test_a_source_request_retries_a_silent_server_within_its_deadline(
    silent: tuple[str, list[socket.socket]],
) -> None:
    url, accepted = silent
    opts = Options.parse({"url": url, "stream": "in", "requestTimeoutSeconds": "2"})
    outcome: list[BaseException] = []

    def head() -> None:
        try:
            with opts.connect() as conn:
                conn.head("in")
        except BaseException as exc:  # noqa: BLE001 - how it ended is the point
            outcome.append(exc)

    t = threading.Thread(target=head, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "one attempt still waits on a server that never answers"
    assert len(outcome) == 1 and isinstance(outcome[0], OnceflowError), outcome
    assert len(accepted) >= 2, "the deadline was spent on one attempt"
