"""Bad input gets a 4xx with a JSON body saying what was wrong, and changes nothing."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.servers import InProcess
from helpers.txn import T, Txn

pytestmark = pytest.mark.anyio
S = "/v1/stream/"
JSON = {"content-type": "application/json"}


async def make(c: InProcess, name: str = "s", ct: str = "application/json") -> None:
    r = await c.client.put(S + name, headers={"content-type": ct})
    assert r.status_code == 201


def error_message(r: object) -> str:
    body = r.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert body["error"]["message"]
    return str(body["error"]["message"])


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({"producer-id": "p", "producer-epoch": "0"}, "together"),
        ({"producer-id": "", "producer-epoch": "0", "producer-seq": "0"}, "empty"),
        ({"producer-id": "p", "producer-epoch": "abc", "producer-seq": "0"}, "Producer-Epoch"),
        ({"producer-id": "p", "producer-epoch": "1e3", "producer-seq": "0"}, "Producer-Epoch"),
        ({"producer-id": "p", "producer-epoch": "-1", "producer-seq": "0"}, "Producer-Epoch"),
        ({"producer-id": "p", "producer-epoch": "0", "producer-seq": str(2**53)}, "Producer-Seq"),
        ({"producer-id": "p", "producer-epoch": "0", "producer-seq": " 1"}, "Producer-Seq"),
        ({"if-match": "not-an-offset"}, "If-Match"),
    ],
)
async def test_malformed_append_headers_are_400_with_reason(
    onceflow: InProcess, headers: dict[str, str], fragment: str
) -> None:
    await make(onceflow)
    r = await onceflow.client.post(S + "s", content=b'{"a":1}', headers={"content-type": "application/json", **headers})
    assert r.status_code == 400
    assert fragment in error_message(r)
    head = await onceflow.client.head(S + "s")
    assert head.headers["stream-next-offset"] == "0000000000000000_0000000000000000"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{bad", "invalid JSON"),
        (b"[]", "empty JSON array"),
        (b"NaN", "NaN"),
        (b"\xff\xfe", "UTF-8"),
        (b"", "empty body"),
    ],
)
async def test_bad_json_bodies_are_400(onceflow: InProcess, body: bytes, fragment: str) -> None:
    await make(onceflow)
    r = await onceflow.client.post(S + "s", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert fragment in error_message(r)
    assert (await onceflow.client.get(S + "s?offset=-1")).content == b"[]"


async def test_missing_content_type_on_append_is_400(onceflow: InProcess) -> None:
    await make(onceflow, ct="text/plain")
    r = await onceflow.client.post(S + "s", content=b"hello", headers={"content-type": ""})
    assert r.status_code == 400
    assert "Content-Type" in error_message(r)


@pytest.mark.parametrize("offset", ["abc", "../../etc", "0_0", "1", "-2", "0000000000000000_000000000000000x", "now2"])
async def test_malformed_offsets_are_400(onceflow: InProcess, offset: str) -> None:
    await make(onceflow)
    r = await onceflow.client.get(S + "s", params={"offset": offset})
    assert r.status_code == 400
    assert error_message(r)


async def test_offsets_that_are_not_boundaries_or_past_the_end_are_400(onceflow: InProcess) -> None:
    await make(onceflow, ct="text/plain")
    r = await onceflow.client.post(S + "s", content=b"x" * 100, headers={"content-type": "text/plain"})
    end = r.headers["stream-next-offset"]
    off, pos = (int(x) for x in end.split("_"))
    for bad in (
        f"{off:016d}_{pos - 1:016d}",
        f"{off:016d}_{pos + 100:016d}",
        f"{off + 5:016d}_{pos:016d}",
        f"{0:016d}_{10:016d}",
    ):
        r = await onceflow.client.get(S + "s", params={"offset": bad})
        assert r.status_code == 400, bad
        assert "offset" in error_message(r)


async def test_repeated_offset_parameter_is_400(onceflow: InProcess) -> None:
    await make(onceflow)
    r = await onceflow.client.get(S + "s?offset=-1&offset=now")
    assert r.status_code == 400


async def test_unknown_live_mode_is_400(onceflow: InProcess) -> None:
    await make(onceflow)
    r = await onceflow.client.get(S + "s", params={"offset": "-1", "live": "websocket"})
    assert r.status_code == 400
    assert "live" in error_message(r)


async def test_body_over_the_limit_is_413_and_not_stored(onceflow: InProcess) -> None:
    await make(onceflow, ct="application/octet-stream")
    big = b"x" * (64 * 1024 + 1)
    r = await onceflow.client.post(S + "s", content=big, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413
    assert "limit" in error_message(r)
    r = await onceflow.client.put(S + "t", content=big, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413
    assert (await onceflow.client.head(S + "t")).status_code == 404
    assert (await onceflow.client.get(S + "s?offset=-1")).content == b""


@pytest.mark.parametrize(
    "name",
    [
        "..",
        "a/../../b",
        "a/./b",
        "/etc/passwd",
        "a//b",
        "trailing/",
        "nul\x00byte",
        "ctl\x01",
        "back\\slash",
        "x" * 1025,
    ],
)
async def test_names_that_could_escape_the_data_directory_are_rejected(onceflow: InProcess, name: str) -> None:
    # percent-encode so that the client sends the name verbatim (no dot-segment normalisation)
    raw = quote(name, safe="/").replace(".", "%2E")
    r = await onceflow.client.put(S + raw, headers={"content-type": "text/plain"}, content=b"x")
    assert r.status_code == 400, (name, r.status_code)
    assert "name" in error_message(r)
    fs = onceflow.broker.fs
    assert sorted(fs.listdir(onceflow.data)) == ["coordinator", "streams", "trash"]
    assert fs.listdir(onceflow.data / "streams") == []


async def test_stream_directories_are_hashes_never_client_text(onceflow: InProcess) -> None:
    await make(onceflow, "tenant/a/b", ct="text/plain")
    (d,) = onceflow.broker.fs.listdir(onceflow.data / "streams")
    assert all(c in "0123456789abcdef" for c in d)


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({"stream-ttl": "-1"}, "Stream-TTL"),
        ({"stream-ttl": "1.5"}, "Stream-TTL"),
        ({"stream-ttl": "0100"}, "Stream-TTL"),
        ({"stream-expires-at": "tomorrow"}, "Stream-Expires-At"),
        ({"stream-ttl": "10", "stream-expires-at": "2099-01-01T00:00:00Z"}, "not both"),
        ({"stream-forked-from": "/v1/stream/src", "stream-fork-offset": "zzz"}, "Stream-Fork-Offset"),
        ({"stream-fork-sub-offset": "1"}, "requires Stream-Forked-From"),
    ],
)
async def test_bad_create_headers_are_400(onceflow: InProcess, headers: dict[str, str], fragment: str) -> None:
    await make(onceflow, "src")
    r = await onceflow.client.put(S + "new", headers={"content-type": "application/json", **headers})
    assert r.status_code == 400
    assert fragment in error_message(r)
    assert (await onceflow.client.head(S + "new")).status_code == 404


async def test_unsupported_method_is_405(onceflow: InProcess) -> None:
    await make(onceflow)
    r = await onceflow.client.patch(S + "s", content=b"x")
    assert r.status_code == 405
    assert "PATCH" in error_message(r)


async def test_paths_outside_the_stream_prefix_are_404_json(onceflow: InProcess) -> None:
    r = await onceflow.client.get("/etc/passwd")
    assert r.status_code == 404
    assert error_message(r)


header_values = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "0", "-1", "true", "TRUE", "now", "9" * 30, "0000000000000000_0000000000000000", "\u00e9"]),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["POST", "PUT", "GET", "HEAD", "DELETE"]),
    headers=st.dictionaries(
        st.sampled_from(
            [
                "content-type",
                "producer-id",
                "producer-epoch",
                "producer-seq",
                "stream-seq",
                "stream-closed",
                "stream-ttl",
                "stream-expires-at",
                "if-match",
                "if-none-match",
                "stream-forked-from",
                "stream-fork-offset",
                "stream-fork-sub-offset",
            ]
        ),
        header_values,
        max_size=5,
    ),
    query=st.dictionaries(st.sampled_from(["offset", "live", "cursor"]), header_values, max_size=3),
    body=st.binary(max_size=64),
)
async def test_fuzzed_requests_never_5xx_and_rejections_change_nothing(
    onceflow: InProcess, method: str, headers: dict[str, str], query: dict[str, str], body: bytes
) -> None:
    c = onceflow.client
    if (await c.head(S + "fz")).status_code == 404:
        await make(onceflow, "fz")
        await c.post(S + "fz", content=b'{"seed":1}', headers={"content-type": "application/json"})
    before = (await c.head(S + "fz")).headers.get("stream-next-offset")
    safe_headers = {
        k: v.encode("utf-8") for k, v in headers.items() if "\n" not in v and "\r" not in v and "\x00" not in v
    }
    if query.get("live") in ("sse", "long-poll"):
        query = {**query, "live": "long-poll"}
    r = await c.request(
        method, S + "fz", headers=safe_headers, params=query, content=body if method in ("POST", "PUT") else None
    )
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400 and method != "HEAD":
        assert r.json()["error"]["message"]
        after = (await c.head(S + "fz")).headers.get("stream-next-offset")
        assert after == before


def test_data_dir_layout_is_documented(tmp_path: Path) -> None:
    # streams/, trash/ and the transaction coordinator's log; nothing else is created or served
    from onceflow.core.broker import Broker

    b = Broker(tmp_path)
    b.open()
    assert sorted(os.listdir(tmp_path)) == ["coordinator", "streams", "trash"]
    b.coordinator.log.close_files()  # type: ignore[union-attr]


# ---------------------------------------------------------------------- deeply nested JSON (issue 15, item 13)

DEEP = b"[" * 20_000 + b"]" * 20_000  # within the 64 KiB test limit, far past the recursion limit
DEEP_OBJECT = b'{"a":' * 6_000 + b"1" + b"}" * 6_000


async def test_deeply_nested_json_bodies_are_400_and_change_nothing(onceflow: InProcess) -> None:
    c = onceflow.client
    await make(onceflow)
    for body in (DEEP, DEEP_OBJECT):
        r = await c.post(S + "s", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nested" in error_message(r)
        r = await c.put(S + "deep", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert (await c.head(S + "deep")).status_code == 404
    assert (await c.get(S + "s?offset=-1")).content == b"[]"
    for path in (
        "/v1/txn/t/init",
        "/v1/txn/t/commit",
        "/v1/groups/g/offsets",
        "/v1/sinks/k/commit",
        "/v1/sinks/k/abort",
    ):
        for body in (DEEP, DEEP_OBJECT):
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert "nested" in error_message(r)
    assert (await c.get("/v1/txn/t")).status_code == 404
    assert (await c.get("/v1/groups/g/offsets")).json()["offsets"] == {}
    assert (await c.get("/v1/sinks/k")).json()["batch"] is None


# ---------------------------------------------------------------------- names that are not UTF-8 (issue 15, item 13)


async def test_a_path_that_is_not_utf8_is_400_in_process(onceflow: InProcess) -> None:
    c = onceflow.client
    for raw in ("bad%ff", "bad%fe", "ok/bad%C3"):
        r = await c.put(S + raw, headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "UTF-8" in error_message(r), (raw, r.status_code, r.text)
    assert (await c.get("/v1/streams")).json() == {"streams": []}
    assert (
        await c.put(S + "bad%ef%bf%bd", headers={"content-type": "text/plain"})
    ).status_code == 201  # U+FFFD is UTF-8
    assert [s["name"] for s in (await c.get("/v1/streams")).json()["streams"]] == ["bad\ufffd"]


@pytest.mark.parametrize("front", ["native", "uvicorn"])
def test_a_path_that_is_not_utf8_is_400_on_both_http_front_ends(tmp_path: Path, front: str) -> None:
    """Each front end percent-decodes differently (surrogates; U+FFFD replacements): the app decodes
    the raw path itself, strictly, so neither creates a stream for such a name nor maps two to one."""
    import httpx

    from helpers.servers import ServerProcess

    srv = ServerProcess(tmp_path / "data", "--http", front)
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            for raw in ("bad%ff", "bad%fe", "bad%c3"):
                r = c.put(S + raw, headers={"content-type": "text/plain"})
                assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], (raw, r.status_code, r.text)
                assert c.get(S + raw, params={"offset": "-1"}).status_code == 400
            assert c.get("/v1/streams").json() == {"streams": []}
            assert c.put(S + "bad%ef%bf%bd", headers={"content-type": "text/plain"}).status_code == 201
            assert c.put(S + "bad%ff", headers={"content-type": "text/plain"}).status_code == 400  # not the same stream
            assert [s["name"] for s in c.get("/v1/streams").json()["streams"]] == ["bad\ufffd"]
    finally:
        srv.kill()


async def test_a_duplicated_protocol_header_is_400_without_a_guard_too(onceflow: InProcess) -> None:
    """A proxy reading the last of two headers and the server the first would disagree on the request."""
    await make(onceflow)
    base = [("content-type", "application/json"), ("producer-epoch", "0"), ("producer-seq", "0")]
    r = await onceflow.client.post(S + "s", content=b"{}", headers=[*base, ("producer-id", "a"), ("Producer-Id", "b")])
    assert r.status_code == 400 and "more than once" in error_message(r)
    r = await onceflow.client.post(
        S + "s", content=b"{}", headers=[*base, ("producer-id", "a"), ("content-type", "text/plain")]
    )
    assert r.status_code == 400 and "content-type" in error_message(r)
    assert (await onceflow.client.head(S + "s")).headers["stream-next-offset"] == "0000000000000000_0000000000000000"
    r = await onceflow.client.post(
        S + "s", content=b"{}", headers=[*base, ("producer-id", "a"), ("x-trace", "1"), ("x-trace", "2")]
    )
    assert r.status_code == 200  # other headers may repeat


@pytest.mark.anyio
async def test_a_lone_surrogate_in_a_control_body_is_400(onceflow: InProcess) -> None:
    """Issue 28, item 10: JSON can spell a lone UTF-16 surrogate ("\\ud800"), Unicode text cannot; a
    transaction's request id and a subscription's pattern holding one were a 500 where they were
    encoded. Every control body's strings must be text: a 400 that says so, and nothing created."""
    c = onceflow.client
    lone = b'"\\ud800"'
    for path, method, body in (
        ("/v1/txn/tx/init", "POST", b'{"request_id": ' + lone + b"}"),
        ("/v1/groups/g/offsets", "POST", b'{"offsets": {' + lone + b': "-1"}}'),
        (
            "/v1/stream/__ds/subscriptions/s1",
            "PUT",
            b'{"type": "pull-wake", "pattern": "a' + lone[1:] + b', "wake_stream": "w"}',
        ),
    ):
        r = await c.request(method, path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert "surrogate" in r.text, (path, r.text[:300])
    assert (await c.get("/v1/txn/tx")).status_code == 404
    assert (await c.get("/v1/stream/__ds/subscriptions/s1")).status_code == 404


@pytest.mark.anyio
async def test_headers_that_carry_names_are_utf8(onceflow: InProcess) -> None:
    """Issue 28, item 9: ``Stream-Retention-Keep-Groups`` was decoded as Latin-1, so a group named
    with a non-ASCII letter never matched and retention kept everything for that stream. Names are
    UTF-8 in paths and bodies; so are the headers that carry them (a fork's source, the groups
    retention keeps for, a transactional id), and bytes that are not UTF-8 there are a 400."""
    c = onceflow.client
    octets = (b"content-type", b"application/octet-stream")
    r = await c.put(S + "kept", headers=[octets, (b"stream-retention-keep-groups", "grüppe,b".encode())])
    assert r.status_code == 201, r.text
    listed = {s["name"]: s for s in (await c.get("/v1/streams")).json()["streams"]}
    assert listed["kept"]["retention_keep_groups"] == ["grüppe", "b"], listed["kept"]
    assert (await c.put(S + "qüelle", headers=[octets])).status_code == 201
    r = await c.put(S + "fork", headers=[octets, (b"stream-forked-from", "qüelle".encode())])
    assert r.status_code == 201, r.text
    assert {s["name"]: s for s in (await c.get("/v1/streams")).json()["streams"]}["fork"]["forked_from"] == "qüelle"
    for name, value in (
        (b"stream-retention-keep-groups", b"gr\xfcppe"),
        (b"stream-forked-from", b"q\xfcelle"),
        (b"transaction-id", b"t\xff"),
    ):
        r = await c.put(S + "bad", headers=[octets, (name, value)])
        assert r.status_code == 400 and "UTF-8" in r.text, (name, r.status_code, r.text)
    assert (await c.head(S + "bad")).status_code == 404


@pytest.mark.anyio
async def test_an_offsets_commit_names_streams_that_exist_and_names_of_bounded_size(onceflow: InProcess) -> None:
    """Issue 28, item 4: an offsets commit took 50,000 offsets for streams that do not exist, and
    stream or group names of megabytes (names are capped at 1,024 bytes everywhere else); each stayed
    in the coordinator's memory and log, in every ``GET /v1/groups`` and every scrape. Now a name
    past the cap is a 400, an offset for a stream that does not exist a 404; nothing is stored."""
    c = onceflow.client
    assert (await c.put(S + "real", headers=JSON)).status_code == 201
    end = (await c.post(S + "real", content=b"[1]", headers=JSON)).headers["stream-next-offset"]
    long = "x" * 1025
    many = {f"nope{i}": end for i in range(50)}
    t = Txn(c, "tx")
    await t.init()
    for path, body, status in (
        ("/v1/groups/g/offsets", {"offsets": many}, 404),
        ("/v1/groups/g/offsets", {"offsets": {long: end}}, 400),
        (f"/v1/groups/{long}/offsets", {"offsets": {"real": end}}, 400),
        (T + "tx/offsets", {"epoch": t.epoch, "group": "g", "offsets": many}, 404),
        (T + "tx/offsets", {"epoch": t.epoch, "group": long, "offsets": {"real": end}}, 400),
    ):
        r = await c.post(path, json=body)
        assert r.status_code == status, (path[:40], r.status_code, r.text[:200])
    assert (await c.get("/v1/groups/g/offsets")).json()["offsets"] == {}
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"real": end}})).status_code == 200
    listed = (await c.get("/v1/groups")).json()["groups"]
    assert [g["group"] for g in listed] == ["g"], listed
