"""The floors under a single-message append: what onceflow's HTTP server costs with an app that does
nothing, and what the app costs with no HTTP at all.

``bench compare`` runs the same wrk load against :func:`serve_noop` (onceflow's own HTTP/1.1
server, uvloop, an ASGI app that reads the body and answers 204) as against ``onceflow serve``: the
server CPU per request there is the floor of an HTTP request in Python on this machine, whatever the
app does. :func:`app_cost` drives the real app (the broker, ``fsync always``, 75 concurrent
appenders) through ASGI calls in one process, with no sockets: the CPU per append of everything but
HTTP. The two together explain the CPU per append of ``onceflow serve``.

Run as ``python -m onceflow_tools.bench.floor serve|app`` (the bench starts both itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from onceflow.testing.processes import ServerProcess

_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_NEXT = (b"stream-next-offset", b"0000000000000001_0000000000000064")


async def _noop_app(scope: MutableMapping[str, Any], receive: _Receive, send: _Send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 204, "headers": [_NEXT]})
    await send({"type": "http.response.body", "body": b""})


async def _serve(port: int) -> None:
    from onceflow.server.http import start_server
    from onceflow.server.run import tune_gc

    tune_gc()
    server = await start_server(_noop_app, "127.0.0.1", port)
    print(f"onceflow listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def serve_noop() -> ServerProcess:
    """The no-op app on onceflow's HTTP server, on a free loopback port (not started)."""
    argv = [sys.executable, "-m", "onceflow_tools.bench.floor", "serve"]
    return ServerProcess("HTTP floor (no-op app)", argv, re.compile(r"onceflow listening on (http://\S+)"))


async def _app_cost(appends: int, concurrency: int) -> float:
    from onceflow.core.broker import Broker
    from onceflow.server.app import AppConfig
    from onceflow.server.run import build_handler, tune_gc

    tune_gc()
    with tempfile.TemporaryDirectory() as d:
        broker = Broker(d, fsync="always")
        broker.open()
        await broker.start()
        _, handler = build_handler(broker, AppConfig(), None)
        base: dict[str, Any] = {"type": "http", "scheme": "http", "query_string": b"", "path": "/v1/stream/floor"}
        base.update(raw_path=b"/v1/stream/floor", server=("127.0.0.1", 4437), client=("127.0.0.1", 50000))
        headers = [(b"host", b"127.0.0.1:4437"), (b"content-type", b"application/json")]
        body = b'{"k":"0123456789012345678901234567890123456789","v":12345,"note":"abcdefghijklmnopqrstuvwxyzabcdef"}'
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await handler(
            dict(base, method="PUT", headers=headers[:1] + [(b"content-type", b"application/json")]), receive, send
        )
        scope = dict(base, method="POST", headers=[*headers, (b"content-length", str(len(body)).encode())])
        each = appends // concurrency

        async def appender() -> None:
            for _ in range(each):
                await handler(scope, receive, send)

        cpu = time.process_time()
        await asyncio.gather(*(appender() for _ in range(concurrency)))
        cpu = time.process_time() - cpu
        await broker.close()
    if statuses[0] != 201 or any(s != 204 for s in statuses[1:]):
        raise RuntimeError(f"the app answered {sorted(set(statuses))}, not 201 then 204")
    return cpu / (each * concurrency) * 1e6


def app_cost(appends: int = 30_000, concurrency: int = 75) -> float:
    """CPU microseconds per append of the app alone (in a child process, so that nothing of the bench's
    own process counts)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "onceflow_tools.bench.floor", "app", str(appends), str(concurrency)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout)["us_per_append"])


def main(argv: list[str] | None = None) -> None:
    import uvloop

    p = argparse.ArgumentParser(prog="python -m onceflow_tools.bench.floor")
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("serve", help="the no-op app on onceflow's HTTP server, on a free loopback port")
    a = sub.add_parser("app", help="CPU per append of the app alone, as JSON")
    a.add_argument("appends", type=int, nargs="?", default=30_000)
    a.add_argument("concurrency", type=int, nargs="?", default=75)
    args = p.parse_args(argv)
    if args.what == "serve":
        uvloop.run(_serve(0))
    else:
        us = uvloop.run(_app_cost(args.appends, args.concurrency))
        print(json.dumps({"us_per_append": us}))


if __name__ == "__main__":
    main()
