"""onceflow.testing's server processes: ready when they print their URL, or, on a shared store, once
they lead it (a server that listens but does not lead answers 503 not_leader)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

from onceflow.testing import ServerFailure, ServerProcess, onceflow_server

LISTENING = re.compile(r"listening on (http://\S+)")


def _child(*lines: str) -> list[str]:
    """A child that prints ``lines`` a moment apart, then waits to be stopped."""
    script = (
        "import sys, time\nfor line in sys.argv[1:]:\n    print(line, flush=True)\n    time.sleep(0.2)\ntime.sleep(60)"
    )
    return [sys.executable, "-c", script, *lines]


def test_a_server_is_ready_at_its_listening_line() -> None:
    server = ServerProcess("child", _child("listening on http://127.0.0.1:1/", "leads"), LISTENING)
    try:
        server.start(timeout=30)
        assert server.url == "http://127.0.0.1:1"
    finally:
        server.stop()


def test_a_server_given_a_serving_line_is_ready_only_once_it_printed_it() -> None:
    argv = _child("listening on http://127.0.0.1:1", "recovering", "leads the store")
    server = ServerProcess("child", argv, LISTENING, serving=re.compile("leads the store"))
    try:
        server.start(timeout=30)
        assert server.url == "http://127.0.0.1:1"
        assert server.output_tail().splitlines()[-1].endswith("leads the store")
    finally:
        server.stop()


def test_a_serving_line_before_the_listening_line_does_not_count() -> None:
    argv = _child("leads the store", "listening on http://127.0.0.1:1")
    server = ServerProcess("child", argv, LISTENING, serving=re.compile("leads the store"))
    try:
        with pytest.raises(ServerFailure, match="not ready"):
            server.start(timeout=1.5)
    finally:
        server.stop()


@pytest.mark.slow
def test_onceflow_server_on_a_store_is_ready_once_it_serves(pg: str, tmp_path: Path) -> None:
    pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")
    server = onceflow_server(tmp_path / "unused", store=pg)
    try:
        server.start()
        r = httpx.put(f"{server.url}/v1/stream/s", headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 201  # not 503 not_leader
        assert not (tmp_path / "unused").exists()
    finally:
        server.stop()
