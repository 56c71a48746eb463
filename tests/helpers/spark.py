"""Reading a whole stream over HTTP, as the Spark tests check what a query wrote; a server whose
retention deletes small segments at once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from helpers.servers import ServerProcess


def read_all(url: str, name: str, isolation: str = "read_committed") -> list[Any]:
    out: list[Any] = []
    offset = "-1"
    while True:
        r = httpx.get(f"{url}/v1/stream/{name}", params={"offset": offset, "isolation": isolation})
        assert r.status_code == 200, r.text
        out += r.json()
        if r.headers.get("stream-up-to-date") == "true":
            return out
        offset = r.headers["stream-next-offset"]


@contextlib.contextmanager
def retention_server(data: Path) -> Iterator[str]:
    """A server whose segments hold about 600 bytes and whose retention runs every 0.2 s: a test
    can have appends deleted under a query. Yields its URL."""
    srv = ServerProcess(data, "--segment-bytes", "600", "--retention-check-interval", "0.2")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()


JSON = {"content-type": "application/json"}


def fill(url: str, name: str, n: int, **headers: str) -> list[str]:
    """Create ``name`` and append ``n`` messages of ~80 bytes one by one; the offset after each."""
    r = httpx.put(f"{url}/v1/stream/{name}", headers={**JSON, **headers})
    assert r.status_code == 201, r.text
    out = []
    for i in range(n):
        r = httpx.post(f"{url}/v1/stream/{name}", json=[{"id": i, "pad": "x" * 60}], headers=JSON)
        assert r.status_code in (200, 204), r.text
        out.append(r.headers["stream-next-offset"])
    return out


def earliest_after_retention(url: str, name: str) -> str:
    """Wait until retention deleted the start of ``name``, then for one more sweep (each deletes all
    it may, and nothing is appended any more): the earliest offset kept from then on."""
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:  # the server's sweep runs every ~1 s
        if "stream-earliest-offset" in httpx.head(f"{url}/v1/stream/{name}").headers:
            time.sleep(1.5)
            return httpx.head(f"{url}/v1/stream/{name}").headers["stream-earliest-offset"]
        time.sleep(0.1)
    raise AssertionError(f"retention never deleted the start of {name}")
