"""Reading a whole stream over HTTP, as the Spark tests check what a query wrote."""

from __future__ import annotations

from typing import Any

import httpx


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
