"""``onceflow serve --store postgresql://…`` (server/leader.py, docs/ha.md): servers sharing one
database, one leading by the store's lease; followers answer 503 ``not_leader`` naming the leader; a
follower takes over when the leader dies (kill -9: after the lease's term; a clean stop: at once),
and nothing acknowledged is lost or doubled; a leader whose lease was taken writes nothing more and
exits."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

from helpers.servers import ServerProcess  # noqa: E402
from onceflow.server.leader import LEASE_LOST_EXIT  # noqa: E402
from onceflow.wire import compress  # noqa: E402

JSON = {"Content-Type": "application/json"}


def pg_url(conninfo: str) -> str:
    """The ``pg`` fixture's key=value conninfo as the URL ``--store`` takes."""
    kv = dict(part.split("=", 1) for part in conninfo.split())
    return f"postgresql://{kv['user']}@{kv['host']}:{kv['port']}/{kv['dbname']}"


def leads(server: ServerProcess) -> bool:
    try:
        return bool(httpx.get(f"{server.url}/v1/leader", timeout=2.0).json()["leads"])
    except httpx.TransportError:
        return False


def wait_for_leader(*servers: ServerProcess, within: float = 30.0) -> ServerProcess:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None and leads(s):
                return s
        time.sleep(0.05)
    raise AssertionError(f"no server took the lead within {within} s")


@pytest.fixture
def pair(pg: str, tmp_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    store = pg_url(pg)
    servers = tuple(ServerProcess(tmp_path / f"unused{i}", "--store", store, "--lease-seconds", "2") for i in range(2))
    try:
        for s in servers:
            s.start()
        yield servers  # type: ignore[misc]
    finally:
        for s in servers:
            s.kill()


def test_one_server_leads_and_the_other_passes_requests_on_to_it(pair: tuple[ServerProcess, ServerProcess]) -> None:
    leader = wait_for_leader(*pair)
    follower = pair[1] if leader is pair[0] else pair[0]
    assert httpx.get(f"{follower.url}/v1/leader").json() == {"leads": False, "me": follower.url, "leader": leader.url}
    assert httpx.get(f"{leader.url}/v1/leader").json() == {"leads": True, "me": leader.url, "leader": leader.url}
    assert httpx.put(f"{follower.url}/v1/stream/orders", headers=JSON).status_code == 201
    r = httpx.post(f"{follower.url}/v1/stream/orders", content=b"[1, 2]", headers=JSON)
    assert r.status_code == 204 and r.headers["stream-next-offset"]  # the leader's answer
    assert httpx.get(f"{leader.url}/v1/stream/orders", params={"offset": "-1"}).json() == [1, 2]
    # a long-poll through the follower wakes when an append lands on the leader (the servers'
    # long-poll timeout is 0.5 s: the poll is tried until one sees the append)
    tail = r.headers["stream-next-offset"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _ in range(20):
            poll = pool.submit(
                httpx.get, f"{follower.url}/v1/stream/orders", params={"offset": tail, "live": "long-poll"}, timeout=10
            )
            time.sleep(0.1)
            if not poll.done():
                break
        assert httpx.post(f"{leader.url}/v1/stream/orders", content=b"[3]", headers=JSON).status_code == 204
        live = poll.result()
    assert live.status_code == 200 and live.json() == [3]


def test_with_no_forward_a_follower_names_the_leader(pg: str, tmp_path: Path) -> None:
    store = pg_url(pg)
    a = ServerProcess(tmp_path / "a", "--store", store, "--no-forward")
    b = ServerProcess(tmp_path / "b", "--store", store, "--no-forward")
    try:
        a.start()
        assert wait_for_leader(a) is a
        b.start()
        assert httpx.put(f"{a.url}/v1/stream/orders", headers=JSON).status_code == 201
        r = httpx.post(f"{b.url}/v1/stream/orders", content=b"[1]", headers=JSON)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "not_leader"
        assert r.headers["onceflow-leader"] == a.url == r.json()["error"]["leader"]
        assert httpx.get(f"{a.url}/v1/stream/orders", params={"offset": "-1"}).json() == []
        # the HTTP layer's own answers are counted by the leader's /metrics too (they were not)
        heads = "".join(f"x-h{i}: v\r\n" for i in range(120))
        with socket.create_connection(("127.0.0.1", int(a.url.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(f"GET /metrics HTTP/1.1\r\nhost: x\r\n{heads}\r\n".encode())
            assert s.recv(65536).startswith(b"HTTP/1.1 431")
        scraped = httpx.get(f"{a.url}/metrics").text
        assert 'onceflow_http_refused_total{code="too_many_headers",status="431"} 1.0' in scraped
    finally:
        a.kill()
        b.kill()


def test_after_the_leader_is_killed_the_other_serves_everything_it_acknowledged(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    leader = wait_for_leader(*pair)
    follower = pair[1] if leader is pair[0] else pair[0]
    assert httpx.put(f"{leader.url}/v1/stream/orders", headers=JSON).status_code == 201
    producer = {**JSON, "Producer-Id": "p", "Producer-Epoch": "0"}
    for seq in range(20):
        r = httpx.post(
            f"{leader.url}/v1/stream/orders",
            content=f'[{{"n": {seq}}}]',
            headers={**producer, "Producer-Seq": str(seq)},
        )
        assert r.status_code == 200
    leader.kill()  # kill -9: the lease runs out after its term, then the follower takes it
    assert wait_for_leader(follower) is follower
    # the last append again (its answer lost, say), now through the new leader: a duplicate
    again = httpx.post(
        f"{follower.url}/v1/stream/orders", content=b'[{"n": 19}]', headers={**producer, "Producer-Seq": "19"}
    )
    assert again.status_code == 204
    r = httpx.post(
        f"{follower.url}/v1/stream/orders", content=b'[{"n": 20}]', headers={**producer, "Producer-Seq": "20"}
    )
    assert r.status_code == 200
    got = httpx.get(f"{follower.url}/v1/stream/orders", params={"offset": "-1"}).json()
    assert got == [{"n": n} for n in range(21)]


def test_a_clean_stop_hands_the_lease_over_without_waiting_for_its_term(pg: str, tmp_path: Path) -> None:
    store = pg_url(pg)
    a = ServerProcess(tmp_path / "a", "--store", store, "--lease-seconds", "120")
    b = ServerProcess(tmp_path / "b", "--store", store, "--lease-seconds", "120")
    try:
        a.start()
        assert wait_for_leader(a) is a
        b.start()
        assert not leads(b)
        a.stop()  # SIGTERM: finishes, gives the lease up
        assert wait_for_leader(b, within=60.0) is b  # well before the 120 s term
    finally:
        a.kill()
        b.kill()


def test_a_leader_whose_lease_was_taken_writes_nothing_more_and_exits(pg: str, tmp_path: Path) -> None:
    import psycopg

    # a term of 30 s: the leader renews (and finds the lease taken) only 10 s after it last did, so
    # the append below meets the token check in the store, not a server that already left
    leader = ServerProcess(tmp_path / "a", "--store", pg_url(pg), "--lease-seconds", "30")
    leader.start()
    try:
        assert wait_for_leader(leader) is leader
        assert httpx.put(f"{leader.url}/v1/stream/orders", headers=JSON).status_code == 201
        with psycopg.connect(pg, autocommit=True) as conn:  # as if another server had taken it over
            conn.execute("UPDATE onceflow_lease SET token = token + 100, holder = 'someone else'")
        r = httpx.post(f"{leader.url}/v1/stream/orders", content=b'[{"late": 1}]', headers=JSON)
        assert r.status_code == 503  # refused: fenced by the token in the same database transaction
        assert leader.proc is not None
        assert leader.proc.wait(timeout=60) == LEASE_LOST_EXIT
    finally:
        leader.kill()
    with psycopg.connect(pg) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM onceflow_chunks c JOIN onceflow_files f ON f.id = c.file "
            "WHERE f.path LIKE '/onceflow/streams/%%' AND position('late' in convert_from(c.data, 'latin1')) > 0"
        ).fetchone()
    assert rows == (0,)


def test_a_producer_given_both_servers_carries_on_through_a_leader_kill_exactly_once(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    """The client's failover (client/_failover.py) with the real thing: the leader is killed mid-run,
    the follower takes over after the lease's term, the producer's retries through it are deduplicated."""
    from onceflow.client import IdempotentProducer

    leader = wait_for_leader(*pair)
    both = f"http://127.0.0.1:{pair[0].port},127.0.0.1:{pair[1].port}"
    assert httpx.put(f"{leader.url}/v1/stream/events", headers=JSON).status_code == 201
    with IdempotentProducer(
        both, "events", producer_id="p", epoch=0, content_type="application/json", delivery_timeout=60.0
    ) as producer:
        for n in range(300):
            producer.append({"n": n})
            if n == 100:
                producer.flush()
                leader.kill()  # kill -9, with appends on their way after it
        producer.flush()
    new = wait_for_leader(*pair)
    assert new is not leader
    got = httpx.get(f"{new.url}/v1/stream/events", params={"offset": "-1"}).json()
    assert [m["n"] for m in got] == list(range(300))


def test_a_leader_cut_off_from_the_database_stops_answering_before_another_takes_over(pg: str, tmp_path: Path) -> None:
    """A leader whose database calls hang (a partition: no error, no answer) cannot renew its lease.
    Once the term ran out by the database's clock another server takes over and acknowledges appends;
    the cut-off leader must not go on answering reads from its memory as if it still led (a stale
    answer: the stream ending before an append the new leader acknowledged)."""
    from helpers.relay import FreezableRelay

    kv = dict(part.split("=", 1) for part in pg.split())
    relay = FreezableRelay((kv["host"], int(kv["port"])))
    through_relay = pg_url(pg).replace(f":{kv['port']}/", f":{relay.port}/")
    cut_off = ServerProcess(tmp_path / "a", "--store", through_relay, "--lease-seconds", "2")
    other = ServerProcess(tmp_path / "b", "--store", pg_url(pg), "--lease-seconds", "2")
    try:
        cut_off.start()
        assert wait_for_leader(cut_off) is cut_off
        assert httpx.put(f"{cut_off.url}/v1/stream/orders", headers=JSON).status_code == 201
        assert httpx.post(f"{cut_off.url}/v1/stream/orders", content=b'[{"n": 1}]', headers=JSON).is_success
        relay.freeze()  # its renewals hang from now on
        other.start()
        assert wait_for_leader(other) is other  # the term ran out by the database's clock
        assert httpx.post(f"{other.url}/v1/stream/orders", content=b'[{"n": 2}]', headers=JSON).is_success
        try:
            r = httpx.get(f"{cut_off.url}/v1/stream/orders", params={"offset": "-1"}, timeout=5.0)
        except httpx.TransportError:
            return  # gone: fine
        if r.status_code == 200:  # passed on to the new leader: its answer, not this server's memory
            assert r.json() == [{"n": 1}, {"n": 2}], f"a server whose lease ran out answered from memory: {r.text}"
        else:
            assert (r.status_code, r.json()["error"]["code"]) == (503, "not_leader"), r.text
    finally:
        relay.stop()
        cut_off.kill()
        other.kill()


def test_a_leader_answers_other_requests_while_a_catch_up_read_waits_for_the_database(pg: str, tmp_path: Path) -> None:
    """Issue 30, Finding 7: a read of bytes older than the leader's memory cache waited for the
    database on the event loop, and every other client with it (the leader kept its lease but
    answered nothing: 10-13 s under forty catch-up readers). Here the database holds the read (the
    chunks' table locked by another session, within the read's timeout): the leader answers
    ``GET /v1/leader`` and another read while it waits, and the read gets its bytes once the lock goes."""
    import psycopg

    piece = bytes(range(256)) * 2048  # 512 KiB
    octets = {"Content-Type": "application/octet-stream"}
    leader = ServerProcess(tmp_path / "a", "--store", pg_url(pg), "--store-read-timeout", "60")
    leader.start()
    try:
        assert wait_for_leader(leader) is leader
        assert httpx.put(f"{leader.url}/v1/stream/old", headers=octets).status_code == 201
        for _ in range(3):  # 1.5 MiB: the first bytes are out of the 1 MiB memory cache
            assert httpx.post(f"{leader.url}/v1/stream/old", content=piece, headers=octets).is_success
        released = threading.Event()
        with psycopg.connect(pg) as holder, concurrent.futures.ThreadPoolExecutor(1) as pool:
            holder.execute("LOCK TABLE onceflow_chunks IN ACCESS EXCLUSIVE MODE")

            def release() -> None:
                released.set()
                holder.rollback()

            timer = threading.Timer(20.0, release)  # a bound for a failing test, not a goal
            timer.start()
            try:
                read = pool.submit(httpx.get, f"{leader.url}/v1/stream/old", params={"offset": "-1"}, timeout=90)
                with psycopg.connect(pg, autocommit=True) as watch:
                    for _ in range(1000):  # until the read waits for the lock in the database
                        row = watch.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                            "AND query LIKE '%%FROM onceflow_chunks%%'"
                        ).fetchone()
                        if row is not None and row[0]:
                            break
                        time.sleep(0.01)
                    else:
                        raise AssertionError("the read never reached the database")
                asked = httpx.get(f"{leader.url}/v1/leader", timeout=60)
                head = httpx.head(f"{leader.url}/v1/stream/old", timeout=60)
                answered_while_waiting = not released.is_set() and not read.done()
            finally:
                timer.cancel()
                if not released.is_set():
                    release()
            r = read.result()
        assert answered_while_waiting, "the leader answered nothing while the read waited for the database"
        assert asked.json()["leads"] is True and head.status_code == 200
        assert r.status_code == 200 and r.content == piece * 3
    finally:
        leader.kill()


def raw_answer(server: ServerProcess, request: bytes) -> tuple[bytes, bytes]:
    """The status line and body of ``server``'s answer to ``request``, sent as it is."""
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(request)
        answer = b""
        while more := s.recv(65536):  # to the end: the request says connection: close
            answer += more
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], body


def test_a_follower_answers_an_asterisk_form_target_as_the_leader_does(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    """``OPTIONS *`` (and any request whose target is not a path) through a follower was a 500: the
    forward built the leader's URL from the target ``*``."""
    leader = wait_for_leader(*pair)
    follower = pair[1] if leader is pair[0] else pair[0]
    for method in (b"OPTIONS", b"GET"):
        request = method + b" * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        status, body = raw_answer(leader, request)
        assert status == (b"HTTP/1.1 204 No Content" if method == b"OPTIONS" else b"HTTP/1.1 404 Not Found")
        passed_on = raw_answer(follower, request)
        assert passed_on[0] == status
        assert (b'"not_found"' in passed_on[1]) == (b'"not_found"' in body)  # the body chunked through the follower


def test_an_http10_client_gets_no_chunked_answer_through_a_follower(pair: tuple[ServerProcess, ServerProcess]) -> None:
    """Issue 28, item 8: the follower dropped the leader's ``Content-Length`` (as hop-by-hop), so every
    answer it passed on went out chunked, to an HTTP/1.0 client too (RFC 9112 6.1 forbids it). It
    passes the leader's length on with the leader's body, as it came; an answer without one (a
    live read) goes to a 1.0 client unframed and ends with the connection."""
    leader = wait_for_leader(*pair)
    follower = pair[1] if leader is pair[0] else pair[0]
    assert httpx.put(f"{leader.url}/v1/stream/orders", headers=JSON).status_code == 201
    assert httpx.post(f"{leader.url}/v1/stream/orders", content=b"[1, 2]", headers=JSON).status_code == 204
    read = b"GET /v1/stream/orders?offset=-1 HTTP/1.0\r\nhost: x\r\n\r\n"
    by_leader, by_follower = (raw_head_and_body(s, read) for s in (leader, follower))
    assert by_follower[0].startswith(b"http/1.1 200 ") and by_follower[1] == by_leader[1] == b"[1,2]"
    assert b"transfer-encoding" not in by_follower[0]
    assert b"\r\ncontent-length: 5\r\n" in by_follower[0] and b"\r\ncontent-length: 5\r\n" in by_leader[0]
    head = httpx.head(f"{follower.url}/v1/stream/orders")
    assert head.headers.get("content-length") == httpx.head(f"{leader.url}/v1/stream/orders").headers["content-length"]
    with socket.create_connection(("127.0.0.1", follower.port), timeout=10) as s:
        s.sendall(b"GET /v1/stream/orders?offset=-1&live=sse HTTP/1.0\r\nhost: x\r\n\r\n")
        answer = b""
        while b"data:" not in answer:
            more = s.recv(65536)
            assert more, answer
            answer += more
    top, _, body = answer.lower().partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in top and b"\r\nconnection: close" in top
    assert body.startswith(b"event: data\n"), body[:100]


def test_compressed_bodies_and_answers_pass_through_a_follower_as_the_leader_takes_and_gives_them(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    """Issue 32, item 2: a follower passes a coded body on as it came (its seal binds those bytes, and
    the sealed headers carry ``Content-Encoding``, so the leader decodes what was sealed and bounds
    it as it bounds its own) and the leader's coded answer back undecoded, with the leader's
    ``Content-Encoding``, ``Vary``, weak ``ETag`` and length; a client that asks for no coding
    gets none through it either."""
    leader = wait_for_leader(*pair)
    follower = pair[1] if leader is pair[0] else pair[0]
    url = f"{follower.url}/v1/stream/orders"
    values = [{"id": i, "user": f"user-{i % 50}", "event": "click"} for i in range(200)]
    body = json.dumps(values, separators=(",", ":")).encode()
    assert httpx.put(url, headers=JSON).status_code == 201
    for coding in ("gzip", "zstd"):
        r = httpx.post(url, content=compress(body, coding), headers={**JSON, "content-encoding": coding})
        assert r.status_code == 204, r.text
    bomb = compress(b"\0" * (65 << 20), "zstd")  # more than --max-body (64 MiB) once decoded
    r = httpx.post(url, content=bomb, headers={**JSON, "content-encoding": "zstd"}, timeout=30)
    assert r.status_code == 413 and "decodes to more than" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"not gzip", headers={**JSON, "content-encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip" in r.json()["error"]["message"]
    r = httpx.post(url, content=body, headers={**JSON, "content-encoding": "br"})
    assert r.status_code == 415 and r.headers["accept-encoding"] == "gzip, zstd"
    plain = httpx.get(
        f"{leader.url}/v1/stream/orders", params={"offset": "-1"}, headers={"accept-encoding": "identity"}
    )
    assert plain.json() == values + values
    for coding in ("gzip", "zstd"):
        r = httpx.get(url, params={"offset": "-1"}, headers={"accept-encoding": coding})
        assert r.headers["content-encoding"] == coding and r.headers["vary"] == "accept-encoding"
        assert r.headers["etag"] == "W/" + plain.headers["etag"] and r.content == plain.content
        assert int(r.headers["content-length"]) < len(plain.content) / 3
    r = httpx.get(url, params={"offset": "-1"}, headers={"accept-encoding": "identity"})
    assert "content-encoding" not in r.headers and r.content == plain.content
    head, got = raw_head_and_body(follower, b"GET /v1/stream/orders?offset=-1 HTTP/1.0\r\nhost: x\r\n\r\n")
    assert b"content-encoding" not in head and got == plain.content  # no Accept-Encoding at all


def raw_head_and_body(server: ServerProcess, request: bytes) -> tuple[bytes, bytes]:
    """The head (lower case) and body of ``server``'s answer to ``request``, read until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(request)
        answer = b""
        while more := s.recv(65536):
            answer += more
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.lower(), body


def test_a_follower_that_holds_its_budget_of_bodies_answers_503_to_the_next_until_one_ends(
    pg: str, tmp_path: Path
) -> None:
    """Issue 28, item 1: the bodies a follower holds to pass on share one budget, by default
    ``--max-body``. A client that declared a body and sends it slowly holds its room meanwhile; a
    body that finds no room within 5 s is answered ``503 forward_buffer_full`` (``Retry-After``),
    nothing passed on; once the first body has come and gone on, the next finds room."""
    store = pg_url(pg)
    servers = [ServerProcess(tmp_path / f"unused{i}", "--store", store, "--max-body", "1KiB") for i in range(2)]
    try:
        for s in servers:
            s.start()
        leader = wait_for_leader(*servers)
        follower = servers[1] if leader is servers[0] else servers[0]
        assert (
            httpx.put(f"{leader.url}/v1/stream/orders", headers={"content-type": "text/plain"}, timeout=30).status_code
            == 201
        )
        with socket.create_connection(("127.0.0.1", follower.port), timeout=30) as slow:
            slow.sendall(
                b"POST /v1/stream/orders HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\n"
                b"content-length: 1000\r\n\r\n" + b"a" * 10
            )
            time.sleep(0.5)  # the follower took room for its 1000 bytes
            r = httpx.post(
                f"{follower.url}/v1/stream/orders",
                content=b"b" * 1000,
                headers={"content-type": "text/plain"},
                timeout=30,  # the follower waits 5 s for room, then answers: httpx's 5 s default raced it
            )
            assert (r.status_code, r.json()["error"]["code"], r.headers["retry-after"]) == (
                503,
                "forward_buffer_full",
                "1",
            )
            slow.sendall(b"a" * 990)
            assert slow.recv(4096).startswith(b"HTTP/1.1 204 ")
        r = httpx.post(
            f"{follower.url}/v1/stream/orders", content=b"b" * 1000, headers={"content-type": "text/plain"}, timeout=30
        )
        assert r.status_code == 204
        assert httpx.get(f"{leader.url}/v1/stream/orders", params={"offset": "-1"}).content == b"a" * 1000 + b"b" * 1000
    finally:
        for s in servers:
            s.kill()


class Rogue:
    """A listener that is no onceflow server: it keeps what it is sent and answers 200."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.heard = b""
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in self.heard.rpartition(b"HTTP/1.1\r\n")[2]:
                        more = conn.recv(65536)
                        if not more:
                            break
                        self.heard += more
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    def close(self) -> None:
        self.sock.close()


def guarded_pair(pg: str, tmp_path: Path) -> tuple[ServerProcess, ServerProcess]:
    cfg = tmp_path / "guard.json"
    tokens = {
        "s3cret-ingest": [{"prefix": "", "scopes": ["read", "write"]}],
        "s3cret-report": [{"prefix": "", "scopes": ["read"]}],
    }
    cfg.write_text(json.dumps({"tokens": tokens}))
    store = pg_url(pg)
    return tuple(  # type: ignore[return-value]
        ServerProcess(tmp_path / f"unused{i}", "--store", store, "--lease-seconds", "2", "--guard", str(cfg))
        for i in range(2)
    )


def test_a_follower_hands_no_credentials_to_a_listener_that_is_not_of_the_store(pg: str, tmp_path: Path) -> None:
    """The lease's row named another listener (a wrong --advertise, a port another process took):
    the follower passed the client's bearer token and cookies on to it in clear. It seals them
    with the store's secret: only a server of the store opens them."""
    import psycopg

    servers = guarded_pair(pg, tmp_path)
    rogue = Rogue()
    try:
        for s in servers:
            s.start()
        leader = wait_for_leader(*servers)
        follower = servers[1] if leader is servers[0] else servers[0]
        token = {"Authorization": "Bearer s3cret-ingest", "Cookie": "session=s3cret-cookie"}
        assert httpx.put(f"{follower.url}/v1/stream/orders", headers={**JSON, **token}).status_code == 201
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute("UPDATE onceflow_lease SET address = %s", (rogue.url,))
        deadline = time.monotonic() + 30
        while b"/v1/stream/orders" not in rogue.heard and time.monotonic() < deadline:
            httpx.post(f"{follower.url}/v1/stream/orders", content=b"[1]", headers={**JSON, **token}, timeout=10)
            time.sleep(0.2)
        assert b"/v1/stream/orders" in rogue.heard  # the follower forwarded to it
        assert b"s3cret" not in rogue.heard
    finally:
        rogue.close()
        for s in servers:
            s.kill()


def test_credentials_reach_the_leader_through_a_follower(pg: str, tmp_path: Path) -> None:
    servers = guarded_pair(pg, tmp_path)
    try:
        for s in servers:
            s.start()
        leader = wait_for_leader(*servers)
        follower = servers[1] if leader is servers[0] else servers[0]
        good, bad = {"Authorization": "Bearer s3cret-ingest"}, {"Authorization": "Bearer wrong"}
        assert httpx.put(f"{follower.url}/v1/stream/orders", headers={**JSON, **bad}).status_code == 401
        assert httpx.put(f"{follower.url}/v1/stream/orders", headers=JSON).status_code == 401
        stream = f"{follower.url}/v1/stream/my%20orders"  # a target the forward may encode otherwise
        assert httpx.put(stream, headers={**JSON, **good}).status_code == 201
        producer = {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
        assert httpx.post(stream, content=b"[1, 2]", headers={**JSON, **good, **producer}).status_code == 200
        again = httpx.post(stream, content=b"[1, 2]", headers={**JSON, **good, **producer})  # the headers went on
        assert again.status_code == 204 and again.headers["producer-seq"] == "0"
        read = httpx.get(stream, params={"offset": "-1"}, headers=good)
        assert read.status_code == 200 and read.json() == [1, 2]
    finally:
        for s in servers:
            s.kill()


def answer_to_head(server: ServerProcess, head: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """``server``'s answer (status, headers, body as sent) to a request of which only ``head`` (the
    request line and headers) is ever sent: an answer that waits for the body does not come (a
    timeout). One that comes closes the connection (the body was not read)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head)
        answer = b""
        while more := s.recv(65536):
            answer += more
    top, _, body = answer.partition(b"\r\n\r\n")
    lines = top.split(b"\r\n")
    return int(lines[0].split()[1]), dict(line.lower().split(b": ", 1) for line in lines[1:]), body


def test_a_guarded_follower_refuses_a_request_before_it_reads_the_body(pg: str, tmp_path: Path) -> None:
    """Issue 28, item 1: six anonymous POSTs of 48 MiB to a follower grew it by ~580 MiB, for it read
    each body into memory (and copied it) before passing the request on, to be refused by the
    leader's guard. The follower answers what it can tell from the request's headers as the leader
    does: a missing or unknown token (401) and a token without the scope for the names in the path
    and headers (403), with the leader's own answer, before the body's first byte is sent.

    Its leader (issue 28, item 1 too): a request with an ``Onceflow-Sealed`` header was read whole
    before the seal was tried; one that does not open is now refused before its body."""
    servers = guarded_pair(pg, tmp_path)
    try:
        for s in servers:
            s.start()
        leader = wait_for_leader(*servers)
        follower = servers[1] if leader is servers[0] else servers[0]
        big = b"content-type: application/octet-stream\r\ncontent-length: %d\r\n" % (48 << 20)
        ingest = {"Authorization": "Bearer s3cret-ingest"}
        assert httpx.put(f"{leader.url}/v1/stream/orders", headers={**JSON, **ingest}).status_code == 201
        for who, status in (
            (b"", 401),
            (b"authorization: Bearer wrong\r\n", 401),
            (b"authorization: Bearer s3cret-report\r\n", 403),  # read only: may not append
        ):
            head = b"POST /v1/stream/orders HTTP/1.1\r\nhost: x\r\n" + who + big + b"\r\n"
            by_leader = answer_to_head(leader, head)
            assert by_leader[0] == status
            by_follower = answer_to_head(follower, head)
            assert by_follower == by_leader, who
        bogus = b"onceflow-sealed: AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\r\n"
        status, _, body = answer_to_head(
            leader, b"POST /v1/stream/orders HTTP/1.1\r\nhost: x\r\n" + bogus + big + b"\r\n"
        )
        assert status == 400 and b'"bad_seal"' in body
    finally:
        for s in servers:
            s.kill()
