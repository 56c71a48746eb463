"""What the sink fault tests share with their kill -9 worker (tests/sinks/sink_worker.py): the sinks
under test, built alike in both processes, the input, and how to read each target back.

Input: ``N`` JSON messages ``{"id": i, "v": "value-i"}`` in appends of ``PER_APPEND``; the runner
reads one append per poll (``MAX_READ_BYTES``) and checkpoints every ``CHECKPOINT_MESSAGES``, so
checkpoint ``k`` holds messages ``10(k-1) .. 10k-1``. Every target reads back as ``"id:v"``
strings, compared with the expected ones as lists: a duplicate or a loss shows.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from onceflow.client import IdempotentProducer, Message, Stream
from onceflow.sinks import (
    CheckpointAwareSink,
    FileCheckpointStore,
    OutboxSink,
    Webhook,
    WebhookSink,
)

N = 60
PER_APPEND = 5
CHECKPOINT_MESSAGES = 10
MAX_READ_BYTES = 64

KINDS = ["pg-upsert", "pg-transactional", "pg-2pc", "redis-atomic", "redis-setnx", "outbox", "webhook"]
# kinds whose checkpoints live in a FileCheckpointStore (the others: in the sink, or only in the ack)
WITH_STORE = {"pg-upsert", "pg-2pc", "redis-setnx"}
# the hook where each kind's effect becomes durable (where a commit can fail or lose its answer)
COMMIT_HOOK = {
    "pg-upsert": "on_checkpoint_prepare",
    "redis-setnx": "on_checkpoint_prepare",
    "webhook": "on_checkpoint_prepare",
    "pg-transactional": "on_checkpoint_complete",
    "pg-2pc": "on_checkpoint_complete",
    "redis-atomic": "on_checkpoint_complete",
    "outbox": "on_checkpoint_complete",
}


@dataclass
class Env:
    onceflow: str
    work: str
    pg: str | None = None
    redis: str | None = None
    hooks: str | None = None  # base URL of the webhook receiver

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def value(i: int) -> dict[str, Any]:
    return {"id": i, "v": f"value-{i}"}


def expected() -> list[str]:
    return [f"{i}:value-{i}" for i in range(N)]


def input_stream(job: str) -> str:
    return f"in-{job}"


def outbox_stream(job: str) -> str:
    return f"outbox-{job}"


def hook_entry(job: str, i: int, hooks: str) -> dict[str, Any]:
    """An outbox entry as OutboxSink writes it (the webhook kind's input)."""
    return {
        "id": f"{job}/src/{i}",
        "kind": "webhook",
        "url": f"{hooks}/hook",
        "method": "POST",
        "headers": {},
        "body": value(i),
        "source": {"stream": "src", "offset": "-", "index": i},
    }


def populate(kind: str, env: Env, job: str) -> str:
    """Create the input stream and fill it; returns its tail offset."""
    name = input_stream(job)
    with Stream.connect(env.onceflow, name) as s:
        s.create("application/json")
    with IdempotentProducer(env.onceflow, name, content_type="application/json", max_in_flight=1, linger_ms=0) as p:
        for start in range(0, N, PER_APPEND):
            batch = range(start, start + PER_APPEND)
            if kind == "webhook":
                assert env.hooks is not None
                p.extend([hook_entry(job, i, env.hooks) for i in batch])
            else:
                p.extend([value(i) for i in batch])
            p.flush()
    with Stream.connect(env.onceflow, name) as s:
        return s.head().next_offset


def prepare_target(kind: str, env: Env, job: str) -> None:
    if kind.startswith("pg-"):
        import psycopg

        assert env.pg is not None
        key = "PRIMARY KEY" if kind == "pg-upsert" else ""
        with psycopg.connect(env.pg, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE out_{job.replace('-', '_')} (id integer {key}, v text NOT NULL)")


def table(job: str) -> str:
    return f"out_{job.replace('-', '_')}"


def make_sink(kind: str, env: Env, job: str) -> tuple[CheckpointAwareSink, dict[str, Any]]:
    """The sink of ``kind`` for ``job`` and the SinkRunner keyword arguments it needs."""
    kw: dict[str, Any] = {
        "checkpoint_messages": CHECKPOINT_MESSAGES,
        "max_read_bytes": MAX_READ_BYTES,
        "streams": [input_stream(job)],
    }
    if kind in WITH_STORE:
        kw["checkpoints"] = FileCheckpointStore(Path(env.work) / f"{job}.checkpoints.json")
    sink: CheckpointAwareSink
    if kind.startswith("pg-"):
        from onceflow.sinks import PostgresTransactionalSink, PostgresTwoPhaseSink, PostgresUpsertSink

        assert env.pg is not None
        if kind == "pg-upsert":
            sink = PostgresUpsertSink(env.pg, table(job), ["id", "v"], key_columns=["id"])
        elif kind == "pg-transactional":
            sink = PostgresTransactionalSink(env.pg, table(job), ["id", "v"], job=job)
        else:
            sink = PostgresTwoPhaseSink(env.pg, table(job), ["id", "v"], job=job)
    elif kind == "redis-atomic":
        from onceflow.sinks import RedisAtomicSink

        assert env.redis is not None
        sink = RedisAtomicSink(env.redis, job=job)
    elif kind == "redis-setnx":
        from onceflow.sinks import RedisIdempotentSink

        assert env.redis is not None
        sink = RedisIdempotentSink(env.redis, prefix=f"{job}:", key="id")
    elif kind == "outbox":
        assert env.hooks is not None
        hooks = env.hooks

        def effects(msg: Message) -> list[Webhook]:
            return [Webhook(f"{hooks}/hook", msg.value)]

        sink = OutboxSink(
            env.onceflow, outbox_stream(job), group=job, transactional_id=f"outbox-{job}", effects=effects
        )
        kw["ack"] = None
    elif kind == "webhook":
        sink = WebhookSink(retry_backoff=(0.01, 0.1), delivery_timeout=10.0)
    else:
        raise ValueError(kind)
    return sink, kw


def read_target(kind: str, env: Env, job: str, receiver: HookReceiver | None = None) -> list[str]:
    """The target's content as ``"id:v"`` strings (list order where the target keeps one)."""
    if kind.startswith("pg-"):
        import psycopg

        assert env.pg is not None
        with psycopg.connect(env.pg) as conn:
            return [f"{i}:{v}" for i, v in conn.execute(f"SELECT id, v FROM {table(job)} ORDER BY id").fetchall()]  # noqa: S608
    if kind == "redis-atomic":
        import redis

        assert env.redis is not None
        with redis.Redis.from_url(env.redis) as r:
            return [f"{d['id']}:{d['v']}" for d in map(json.loads, r.lrange(f"onceflow:{{{job}}}:out", 0, -1))]
    if kind == "redis-setnx":
        import redis

        assert env.redis is not None
        with redis.Redis.from_url(env.redis) as r:
            keys = sorted(r.scan_iter(match=f"{job}:*", count=1000), key=lambda k: int(k.split(b":")[-1]))
            out = []
            for k in keys:
                d = json.loads(r.get(k) or b"null")
                assert k.decode() == f"{job}:{d['id']}", (k, d)
                out.append(f"{d['id']}:{d['v']}")
            return out
    if kind == "outbox":
        entries = read_stream(env.onceflow, outbox_stream(job))
        ids = [e["id"] for e in entries]
        assert len(ids) == len(set(ids)), "outbox entry ids must be unique"
        return [f"{e['body']['id']}:{e['body']['v']}" for e in entries]
    if kind == "webhook":
        assert receiver is not None
        return [f"{b['id']}:{b['v']}" for b in receiver.applied]
    raise ValueError(kind)


def read_stream(base_url: str, name: str) -> list[Any]:
    """Every committed message of a JSON stream (read_committed)."""
    with Stream.connect(base_url, name) as s:
        return list(s.messages())


def group_offsets(base_url: str, group: str) -> dict[str, str]:
    resp = httpx.get(f"{base_url}/v1/groups/{group}/offsets")
    resp.raise_for_status()
    offsets: dict[str, str] = resp.json()["offsets"]
    return offsets


# ---------------------------------------------------------------------------------------------- webhooks


class HookReceiver:
    """A webhook receiver that honours ``Idempotency-Key``: the first request with a key applies
    its effect (appends the body to ``applied``) and stores the answer; a repeat gets the stored
    answer and applies nothing.

    Faults, per key: ``fail_before`` answers 503 without applying (the delivery failed);
    ``fail_after`` applies, then answers 500 (the effect happened, the answer says it did not).
    Each fault fires once per key.
    """

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.answers: dict[str, int] = {}
        self.requests = 0
        self.repeats = 0  # requests whose key was already applied
        self.without_key = 0
        self.fail_before: set[str] = set()
        self.fail_after: set[str] = set()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                status = receiver.handle(self.headers.get("idempotency-key"), json.loads(body))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def handle(self, key: str | None, body: Any) -> int:
        with self.lock:
            self.requests += 1
            if key is None:
                self.without_key += 1
                return 400
            if key in self.answers:
                self.repeats += 1
                return self.answers[key]
            if key in self.fail_before:
                self.fail_before.discard(key)
                return 503
            self.applied.append(body)
            self.answers[key] = 200
            if key in self.fail_after:
                self.fail_after.discard(key)
                return 500
            return 200

    def start(self) -> HookReceiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------------------- faults


class CommitFault(ConnectionError):
    """Raised by FaultySink: the commit failed, or (``after=True``) it happened and the answer was lost."""


class FaultySink(CheckpointAwareSink):
    """Wraps a sink; the hook ``hook`` of checkpoint ``checkpoint`` raises :class:`CommitFault`
    before running (``after=False``: the commit fails) or after running (the commit succeeded,
    but the caller is told it failed)."""

    def __init__(self, inner: CheckpointAwareSink, hook: str, checkpoint: int, *, after: bool) -> None:
        self.inner = inner
        self.hook = hook
        self.checkpoint = checkpoint
        self.after = after
        self.fired = False
        self.atomic = inner.atomic  # type: ignore[misc]

    def _maybe(self, hook: str, checkpoint_id: int, run: Callable[[], Any]) -> Any:
        if hook != self.hook or checkpoint_id != self.checkpoint or self.fired:
            return run()
        self.fired = True
        if not self.after:
            raise CommitFault(f"{hook} of checkpoint {checkpoint_id} failed")
        run()
        raise CommitFault(f"{hook} of checkpoint {checkpoint_id} succeeded, but its answer was lost")

    def on_checkpoint_restore(self, checkpoint: Any) -> bool:
        return self.inner.on_checkpoint_restore(checkpoint)

    def on_checkpoint_start(self, checkpoint_id: int) -> None:
        self.inner.on_checkpoint_start(checkpoint_id)

    def write(self, messages: Any) -> None:
        self.inner.write(messages)

    def on_checkpoint_prepare(self, checkpoint_id: int) -> Any:
        return self._maybe(
            "on_checkpoint_prepare", checkpoint_id, lambda: self.inner.on_checkpoint_prepare(checkpoint_id)
        )

    def on_checkpoint_complete(self, checkpoint: Any) -> None:
        self._maybe("on_checkpoint_complete", checkpoint.id, lambda: self.inner.on_checkpoint_complete(checkpoint))

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        self.inner.on_checkpoint_abort(checkpoint_id)

    def load_checkpoint(self) -> Any:
        return self.inner.load_checkpoint()

    def close(self) -> None:
        self.inner.close()


class RedisAnswerDropper:
    """A TCP proxy in front of a Redis server that loses the answer of chosen script calls.

    Every byte is relayed both ways, except: while ``drops`` > 0, the answer to an ``EVALSHA`` (or
    ``EVAL``) that the server *ran* (anything but a ``-NOSCRIPT`` error) is read from the server
    and thrown away, and the client's connection is closed instead. The script has taken effect in
    Redis; the client sees a dropped connection. One thread per direction and connection; redis-py
    waits for each answer before it sends the next command, so answers arrive one read at a time."""

    def __init__(self, upstream_port: int) -> None:
        import socket

        self.upstream_port = upstream_port
        self.drops = 0
        self.dropped = 0
        self.script_calls = 0  # EVALSHA/EVAL requests relayed
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopped = False
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sockets: list[Any] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisAnswerDropper:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stopped = True
        self._listener.close()
        for s in list(self._sockets):
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        import socket

        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            pending = threading.Event()  # a script call was forwarded; its answer is awaited
            for target, args in (
                (self._requests, (client, upstream, pending)),
                (self._answers, (upstream, client, pending)),
            ):
                t = threading.Thread(target=target, args=args, daemon=True)
                t.start()
                self._threads.append(t)

    def _requests(self, client: Any, upstream: Any, pending: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                head = data[:64].upper()
                if b"EVALSHA" in head or b"$4\r\nEVAL\r\n" in head:
                    with self._lock:
                        self.script_calls += 1
                    pending.set()
                upstream.sendall(data)
        _close(client, upstream)

    def _answers(self, upstream: Any, client: Any, pending: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(1 << 16):
                if pending.is_set():
                    pending.clear()
                    with self._lock:
                        drop = self.drops > 0 and not data.startswith(b"-NOSCRIPT")
                        if drop:
                            self.drops -= 1
                            self.dropped += 1
                    if drop:
                        break
                client.sendall(data)
        _close(client, upstream)


def _close(*socks: Any) -> None:
    import socket

    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()
