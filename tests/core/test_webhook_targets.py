"""Where a webhook may be sent (SSRF, issue 15 item 14): public addresses only, unless the operator
allows loopback (or also private) targets with ``--webhook-targets``; IPv4 embedded in IPv6 (NAT64,
6to4, IPv4-mapped, IPv4-compatible) is judged by its IPv4 address; and the connection goes to the
address that was checked, not to a second DNS answer."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from onceflow.core.broker import Broker
from onceflow.core.subscriptions import (
    DeliveryError,
    SubscriptionError,
    WebhookTargets,
    is_public_address,
    validate_webhook_url,
)
from onceflow.server.app import App, AppConfig

pytestmark = pytest.mark.anyio
SUBS = "/v1/stream/__ds/subscriptions"

METADATA_FORMS = [
    "169.254.169.254",
    "::ffff:169.254.169.254",
    "64:ff9b::a9fe:a9fe",
    "64:ff9b:1::a9fe:a9fe",
    "2002:a9fe:a9fe::1",
    "::a9fe:a9fe",
]


@pytest.mark.parametrize(
    "ip",
    [
        *METADATA_FORMS,
        "127.0.0.1",
        "::1",
        "10.1.2.3",
        "64:ff9b::a00:1",
        "2002:a00:1::1",
        "::ffff:127.0.0.1",
        "::7f00:1",
        "0.0.0.0",  # noqa: S104 - addresses judged, not bound
        "::",  # noqa: S104 - addresses judged, not bound
        "100.64.0.1",
        "fc00::1",
        "fe80::1",
        "224.0.0.1",
        "ff02::1",
        "192.0.2.1",
    ],
)
def test_non_public_addresses_in_every_ipv6_wrapping_are_not_public(ip: str) -> None:
    assert not is_public_address(ipaddress.ip_address(ip))


@pytest.mark.parametrize("ip", ["8.8.8.8", "2606:4700::1111", "64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8"])
def test_public_addresses_are_public(ip: str) -> None:
    assert is_public_address(ipaddress.ip_address(ip))


P, L, V, N = "public", "loopback", "private", "never"  # the first --webhook-targets level that allows a URL


@pytest.mark.parametrize(
    ("url", "level"),
    [
        ("https://hooks.example.com/x", P),
        ("https://8.8.8.8/x", P),
        ("https://[64:ff9b::808:808]/x", P),
        ("http://127.0.0.1:8080/hook", L),
        ("http://localhost/hook", L),
        ("https://localhost/hook", L),
        ("http://api.localhost/hook", L),
        ("http://127.0.1.1/hook", L),
        ("https://[::1]/hook", L),
        ("https://[::ffff:127.0.0.1]/hook", L),
        ("http://10.0.0.1/hook", V),
        ("https://192.168.1.5/hook", V),
        ("https://[fd00::1]/hook", V),
        ("https://[64:ff9b::a00:1]/hook", V),
        ("https://printer.local/x", V),
        ("https://metadata.internal/x", V),
        ("https://intranet/x", V),
        ("http://hooks.example.com/x", N),  # plain http only to loopback and private targets
        ("https://169.254.169.254/latest/meta-data", N),  # link-local (cloud metadata): never
        *[(f"https://[{ip}]/x", N) for ip in METADATA_FORMS[1:]],
        ("https://0.0.0.0/x", N),
        ("https://[::]/x", N),
        ("https://[ff02::1]/x", N),
        ("https://[fe80::1]/x", N),
        ("ftp://example.com/x", N),
        ("https://user:pw@example.com/x", N),
    ],
)
def test_webhook_url_policy_at_each_level_of_webhook_targets(url: str, level: str) -> None:
    order = [P, L, V, N]
    targets: WebhookTargets
    for targets in ("public", "loopback", "private"):
        if order.index(level) <= order.index(targets):
            assert validate_webhook_url(url, targets=targets) == url
        else:
            with pytest.raises(SubscriptionError) as err:
                validate_webhook_url(url, targets=targets)
            assert err.value.code == "WEBHOOK_URL_REJECTED", (url, targets)


@pytest.fixture
async def app(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[App]:
    broker = Broker(tmp_path / "data")
    broker.open()
    a = App(broker, AppConfig(webhook_targets=getattr(request, "param", "public")))
    yield a
    await a.subscriptions.close()
    await broker.close()


async def test_a_loopback_webhook_is_refused_by_default(app: App) -> None:
    """An anonymous client could make the server POST to a local admin port."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for url in ("http://127.0.0.1:9/admin", "http://localhost:9/admin", "https://[::ffff:127.0.0.1]:9/x"):
            r = await c.put(f"{SUBS}/s", json={"type": "webhook", "pattern": "e/*", "webhook": {"url": url}})
            assert r.status_code == 400 and r.json()["error"]["code"] == "WEBHOOK_URL_REJECTED", (url, r.text)
        with pytest.raises(DeliveryError, match="not a public address"):
            await app.subscriptions._post("http://127.0.0.1:9/admin", b"{}", {}, 1.0)


@pytest.mark.parametrize("app", ["loopback"], indirect=True)
async def test_loopback_webhooks_are_allowed_behind_the_flag_and_private_ones_still_not(app: App) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.put(
            f"{SUBS}/s", json={"type": "webhook", "pattern": "e/*", "webhook": {"url": "http://127.0.0.1:9/h"}}
        )
        assert r.status_code == 201, r.text
        r = await c.put(
            f"{SUBS}/t", json={"type": "webhook", "pattern": "e/*", "webhook": {"url": "http://10.0.0.1/hook"}}
        )
        assert (
            r.status_code == 400 and r.json()["error"]["code"] == "WEBHOOK_URL_REJECTED"
        )  # what the conformance suite wants
    with pytest.raises(DeliveryError, match="not a public or loopback address"):
        await app.subscriptions._post("http://10.0.0.1:9/admin", b"{}", {}, 1.0)


class Recorder:
    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(200, json={"done": True})


def fake_dns(monkeypatch: pytest.MonkeyPatch, answers: list[str]) -> list[str]:
    """The running loop's resolver answers ``answers`` in turn (a rebinding DNS server); returns the
    hosts asked for."""
    loop = asyncio.get_running_loop()
    asked: list[str] = []

    async def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        asked.append(host)
        ip = answers[min(len(asked) - 1, len(answers) - 1)]
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sockaddr = (ip, port or 443, 0, 0) if family == socket.AF_INET6 else (ip, port or 443)
        return [(family, socket.SOCK_STREAM, 6, "", sockaddr)]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return asked


async def test_the_connection_goes_to_the_address_that_was_checked(app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DNS answer that changes between the check and the connection (rebinding) cannot redirect
    the POST: the checked address is pinned, with Host and SNI kept as the URL's name."""
    asked = fake_dns(monkeypatch, ["8.8.8.8", "127.0.0.1"])
    rec = Recorder()
    app.subscriptions._client = httpx.AsyncClient(transport=httpx.MockTransport(rec))  # no network in this test
    status, _ = await app.subscriptions._post(
        "https://hooks.example.com:8443/wake?x=1", b"{}", {"content-type": "application/json"}, 1.0
    )
    assert status == 200
    (req,) = rec.requests
    assert req.url.host == "8.8.8.8" and req.url.port == 8443 and req.url.raw_path == b"/wake?x=1"
    assert req.headers["host"] == "hooks.example.com:8443"
    assert req.extensions.get("sni_hostname") == "hooks.example.com"
    assert asked == ["hooks.example.com"]  # resolved once, by the check


async def test_a_name_resolving_to_an_embedded_private_address_is_refused(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    for ip in ("64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "::a9fe:a9fe", "::ffff:127.0.0.1"):
        fake_dns(monkeypatch, [ip])
        rec = Recorder()
        app.subscriptions._client = httpx.AsyncClient(transport=httpx.MockTransport(rec))
        with pytest.raises(DeliveryError, match="which is not a public address"):
            await app.subscriptions._post("https://hooks.example.com/wake", b"{}", {}, 1.0)
        assert rec.requests == []


async def test_an_answer_nested_too_deeply_starts_the_lease_instead_of_stalling_the_wake(app: App) -> None:
    """Any 2xx answer that is not {"done": true} starts the lease; a deeply nested one used to raise
    out of the delivery task, leaving a wake with no lease that never ended."""
    deep = b"[" * 50_000 + b"]" * 50_000
    answered: list[httpx.Request] = []

    def receiver(request: httpx.Request) -> httpx.Response:
        answered.append(request)
        return httpx.Response(200, content=deep)

    app.subscriptions._client = httpx.AsyncClient(transport=httpx.MockTransport(receiver))  # no network in this test
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.put(
            f"{SUBS}/s", json={"type": "webhook", "pattern": "e/*", "webhook": {"url": "https://8.8.8.8/hook"}}
        )
        assert r.status_code == 201, r.text
        assert (
            await c.put("/v1/stream/e/a", content=b'{"n":1}', headers={"content-type": "application/json"})
        ).status_code == 201
        sub = app.subscriptions.manager.subs["s"]
        for _ in range(500):  # the delivery runs as a background task
            if answered and (sub.lease_deadline is not None or sub.delivering is None):
                break
            await asyncio.sleep(0.01)
        assert answered and sub.lease_deadline is not None and sub.status == "active"
