"""What the simulation does to run faster, without changing what it runs.

A seed of the cluster spends more of its time in ``httpx``'s machinery than in onceflow's code
(profile of 40 seeds, 2026-11-28: a third in the client's request path, a tenth parsing URLs).
Neither of these changes what runs: a seed's trace and fingerprint are the same with and without
them.

- :func:`fast_httpx` memoizes ``httpx``'s URL parser while a seed runs: every request parses its
  URL several times (the client's base URL merged with the path, the failover transport pointing
  it at a server). The parser is a pure function of its arguments returning an immutable value (a
  named tuple), so a cached answer is the one a fresh parse would give; an invalid URL raises as
  before (an exception is never cached).
- :func:`response` builds a server's answer as ``httpx.Response(..., content=body)`` does, without
  running the body through ``httpx``'s stream, decoder and chunker machinery.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
from httpx import _urlparse, _urls

__all__ = ["fast_httpx", "response"]

_LIMIT = 50_000  # entries; the cache is dropped when full (a seed uses a few thousand)


@contextlib.contextmanager
def fast_httpx() -> Iterator[None]:
    """``httpx``'s URL parsing memoized while the block runs (module docstring)."""
    parse = _urlparse.urlparse
    cache: dict[Any, Any] = {}

    def urlparse(url: str = "", **kwargs: str | None) -> Any:
        key = (url, *kwargs.items()) if kwargs else url
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= _LIMIT:
                cache.clear()
            hit = cache[key] = parse(url, **kwargs)
        return hit

    _urlparse.urlparse = urlparse  # ParseResult.copy_with's
    _urls.urlparse = urlparse  # type: ignore[attr-defined] # httpx.URL's
    try:
        yield
    finally:
        _urlparse.urlparse = parse
        _urls.urlparse = parse  # type: ignore[attr-defined]


def response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> httpx.Response:
    """``httpx.Response(status, headers=headers, content=body)``, the same response (its body read,
    its stream consumed and closed) without running the body through ``httpx``'s stream, decoder
    and chunker machinery (5 % of a seed). Checked against the plain construction by
    tests/tools/test_sim.py; a response with a ``content-encoding`` is built the plain way."""
    if any(k.lower() == b"content-encoding" for k, _ in headers):
        return httpx.Response(status, headers=headers, content=body)
    resp = httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))
    if body:
        resp.headers.setdefault("Content-Length", str(len(body)))  # what encode_content adds
    resp._content = body
    resp.is_stream_consumed = True
    resp.is_closed = True
    resp._num_bytes_downloaded = 0
    return resp
