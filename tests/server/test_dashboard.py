"""The dashboard (``GET /ui``) in a real headless Chromium against a real server with traffic: the
numbers it shows are the API's, and a screenshot is taken (docs/img/dashboard.png comes from
``ONCEFLOW_DASHBOARD_PNG=docs/img/dashboard.png pytest tests/server/test_dashboard.py``)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import threading
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.servers import ServerProcess
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import Guard, GuardConfig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/setup.sh dev installs it)"
)
JSON = {"content-type": "application/json"}


class Page(HTMLParser):
    """What the dashboard shows: card values by id, and table rows by section, key and field."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: dict[str, str] = {}
        self.rows: dict[str, dict[str, dict[str, str]]] = {}
        self._section: str | None = None
        self._row: str | None = None
        self._into: tuple[str, str] | None = None  # ("card", id) or ("cell", field)
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "div" and a.get("id") in ("streams", "groups", "txns", "sinks"):
            self._section = a["id"]
        elif tag == "div" and (a.get("id") or "").startswith("card-"):
            self._into, self._text = ("card", str(a["id"])[5:]), []
        elif tag == "tr" and a.get("data-key") is not None and self._section:
            self._row = a["data-key"]
            self.rows.setdefault(self._section, {})[str(self._row)] = {}
        elif tag == "td" and self._row is not None and a.get("data-field"):
            self._into, self._text = ("cell", str(a["data-field"])), []

    def handle_data(self, data: str) -> None:
        if self._into is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._into is not None and tag in ("div", "td"):
            kind, name = self._into
            text = "".join(self._text).strip()
            if kind == "card":
                self.cards[name] = text
            elif self._section and self._row is not None:
                self.rows[self._section][self._row][name] = text
            self._into = None
        elif tag == "tr":
            self._row = None
        elif tag == "section":
            self._section = None


def chromium(
    url: str, profile: Path, *args: str, height: int = 1500, budget_ms: int = 9000
) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size=1280,{height}",
            f"--virtual-time-budget={budget_ms}",  # several refreshes of the page (its timers run on virtual time)
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def scene(url: str) -> None:
    """Streams with data, a consumer group behind, a transaction left open, a sink with batches."""
    for name in ("orders", "payments", "traffic"):
        assert httpx.put(f"{url}/v1/stream/{name}", headers=JSON).status_code == 201
    after = [
        httpx.post(f"{url}/v1/stream/orders", json=[{"order": i + k} for k in range(10)], headers=JSON)
        for i in range(0, 120, 10)
    ]
    httpx.post(f"{url}/v1/stream/payments", json=[{"payment": k} for k in range(7)], headers=JSON)
    fifty = after[4].headers["stream-next-offset"]  # billing has read 50 of the 120 orders
    r = httpx.post(f"{url}/v1/groups/billing/offsets", json={"offsets": {"orders": fifty}})
    assert r.status_code == 200, r.text
    epoch = httpx.post(f"{url}/v1/txn/loader/init", json={"timeout_ms": 3_600_000}).json()["epoch"]
    txn_headers = {**JSON, "producer-id": "txn:loader", "producer-epoch": str(epoch), "producer-seq": "0"}
    r = httpx.post(
        f"{url}/v1/stream/payments", json=[{"payment": "pending"}], headers={**txn_headers, "transaction-id": "loader"}
    )
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/sinks/daily/commit", json={"batch": 4, "members": [], "query": "q-7f3a", "rows": 2500})
    assert r.status_code == 200, r.text


@needs_chromium
def test_the_dashboard_shows_what_the_api_says_while_traffic_flows(server: ServerProcess, tmp_path: Path) -> None:
    url = server.url
    scene(url)
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client() as c:
            while not stop.is_set():
                c.post(f"{url}/v1/stream/traffic", json=[{"tick": 1}], headers=JSON)

    feeder = threading.Thread(target=traffic, daemon=True)
    feeder.start()
    try:
        page = chromium(f"{url}/ui?interval=1000", tmp_path / "profile", "--dump-dom")
        shot = tmp_path / "dashboard.png"
        taken = chromium(f"{url}/ui?interval=1000", tmp_path / "profile2", f"--screenshot={shot}", height=960)
    finally:
        stop.set()
        feeder.join(timeout=10)
    assert page.returncode == 0, page.stderr[-2000:]
    shown = Page()
    shown.feed(page.stdout)

    streams = httpx.get(f"{url}/v1/streams").json()["streams"]
    assert shown.cards["streams"] == str(len(streams))
    for s in streams:
        if s["name"] != "traffic":  # still growing
            assert shown.rows["streams"][s["name"]]["messages"] == f"{s['messages']:,}", s
    assert shown.rows["streams"]["orders"]["messages"] == "120"
    group = httpx.get(f"{url}/v1/groups").json()["groups"][0]
    assert group["group"] == "billing" and group["lag"] == 70
    assert shown.rows["groups"]["billing"]["lag"] == "70" and shown.cards["group-lag"] == "70"
    txns = httpx.get(f"{url}/v1/txn", params={"open": "true"}).json()["transactions"]
    assert [t["transactional_id"] for t in txns] == ["loader"]
    assert shown.rows["txns"]["loader"]["status"] == "ongoing" and shown.cards["open-txns"] == "1"
    assert shown.rows["streams"]["payments"]["lso_lag"] == "1"  # the open transaction holds one record back
    assert shown.rows["sinks"]["daily"]["batch"] == "4" and shown.rows["sinks"]["daily"]["owner"] == "q-7f3a"
    assert shown.rows["sinks"]["daily"]["rows"] == "2,500"
    assert shown.cards["stuck-txns"] == "0"
    rate = shown.cards["append-rate"].replace(",", "")
    assert rate.isdigit() and int(rate) > 0, shown.cards  # the traffic, seen through /metrics

    assert taken.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", taken.stderr[-2000:]
    target = os.environ.get("ONCEFLOW_DASHBOARD_PNG")
    if target:
        shutil.copyfile(shot, target)


@needs_chromium
@pytest.mark.parametrize("interval", ["soon", "3000000000"])
def test_an_interval_the_page_cannot_use_means_the_default(
    server: ServerProcess, tmp_path: Path, interval: str
) -> None:
    """``/ui?interval=soon`` made the refresh period NaN and ``3000000000`` overflowed the
    browser's timer: either way setInterval ran refresh() back to back, five requests each time.
    In 1.5 s of the page's (virtual) time it must load the listings once, as with the default 2 s."""
    page = chromium(f"{server.url}/ui?interval={interval}", tmp_path / "profile", "--dump-dom", budget_ms=1500)
    assert page.returncode == 0, page.stderr[-2000:]
    listings = sum(
        s.value
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        for s in family.samples
        if s.name == "onceflow_http_request_duration_seconds_count" and s.labels["route"] == "streams.list"
    )
    assert listings == 1


def test_the_page_is_served_whole_with_nothing_from_elsewhere(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert "http://" not in r.text and "https://" not in r.text  # no CDN, no external font or script
    assert httpx.head(f"{server.url}/ui").status_code == 200
    assert httpx.post(f"{server.url}/ui").status_code == 405


def test_the_token_the_docs_name_reads_everything_the_page_fetches(tmp_path: Path) -> None:
    """docs/operations.md names the grants a token needs for the dashboard under --guard; with
    exactly those, every endpoint the page fetches answers (a 403 on any one blanks the page)."""
    page = (Path(__file__).parents[2] / "src/onceflow/server/ui/index.html").read_text()
    fetched = re.findall(r'get\("(/[^"]*)"', page)
    assert {p.split("?")[0] for p in fetched} == {"/v1/streams", "/v1/groups", "/v1/txn", "/v1/sinks", "/metrics"}
    docs = (Path(__file__).parents[2] / "docs/operations.md").read_text()
    said = re.search(r"that token needs (.*?) grants?\s+on\s+the\s+prefix", docs.split("## Dashboard")[1], re.S)
    assert said is not None
    scopes = re.findall(r"`(\w+)`", said.group(1))
    assert scopes

    async def run() -> list[tuple[str, int]]:
        broker = Broker(tmp_path / "data")
        broker.open()
        app = App(broker, AppConfig())
        guard = Guard(app, broker, GuardConfig.from_json({"tokens": {"ui": [{"prefix": "", "scopes": scopes}]}}))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as c:
                return [(p, (await c.get(p, headers={"authorization": "Bearer ui"})).status_code) for p in fetched]
        finally:
            await broker.close()

    answers = asyncio.run(run())
    assert all(status == 200 for _, status in answers), (scopes, answers)
