"""The client factory's clients skip httpx's cookie parsing on answers that set no cookie, and still
keep a cookie that an answer sets (a proxy in front of onceflow may use one)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from onceflow.client.lowlevel import async_http_client, http_client


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = (self.headers.get("cookie") or "").encode()
        self.send_response(200)
        if self.path == "/set":
            self.send_header("set-cookie", "route=b; Path=/")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_cookie_an_answer_sets_is_sent_back(url: str) -> None:
    with http_client(url, timeout=10) as c:
        assert c.get(url + "/plain").text == ""
        assert not c.cookies
        c.get(url + "/set")
        assert c.cookies.get("route") == "b"
        assert c.get(url + "/plain").text == "route=b"


@pytest.mark.anyio
async def test_a_cookie_an_answer_sets_is_sent_back_async(url: str) -> None:
    async with async_http_client(url, timeout=10) as c:
        assert (await c.get(url + "/plain")).text == ""
        await c.get(url + "/set")
        assert (await c.get(url + "/plain")).text == "route=b"
