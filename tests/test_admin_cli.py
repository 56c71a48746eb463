"""``onceflow streams|groups|txn|sinks`` against a real ``onceflow serve`` (docs/operations.md).

The commands run in this process (``cli.main``, output captured: not a terminal, so tables are
plain columns); the server and the clients that make work for them are the real ones. What a
person reads is checked by its rows, what a script reads by ``--json``; every failure is one line
on stderr and exit status 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess, free_port
from onceflow import cli
from onceflow.client import Consumer, GroupOffsetStore, OnceflowError, TransactionalProducer

JSON = {"content-type": "application/json"}
ZERO = "0000000000000000_0000000000000000"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the module (each test uses names of its own); open transactions wait for an operator."""
    srv = ServerProcess(tmp_path_factory.mktemp("admin") / "data", "--txn-timeout", "3600")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()


class Run:
    def __init__(self, capsys: pytest.CaptureFixture[str], url: str) -> None:
        self.capsys, self.url = capsys, url

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        try:
            code = cli.main([*argv, "--url", self.url])
        except SystemExit as exc:  # a usage error: argparse's answer
            code = int(exc.code or 0)
        out, err = self.capsys.readouterr()
        return code, out, err

    def ok(self, *argv: str) -> str:
        code, out, err = self(*argv)
        assert code == 0 and err == "", (argv, code, err)
        return out

    def json(self, *argv: str) -> Any:
        return json.loads(self.ok(*argv, "--json"))

    def fails(self, *argv: str) -> str:
        """A refusal: status 1 and one line on stderr naming the command, no traceback."""
        code, out, err = self(*argv)
        assert code == 1 and out == "", (argv, code, out)
        assert err.count("\n") == 1 and err.startswith(f"onceflow {argv[0]} {argv[1]}: "), err
        assert "Traceback" not in err
        return err


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], url: str) -> Run:
    return Run(capsys, url)


def rows(table: str) -> dict[str, list[str]]:
    """A plain table's rows by their first cell (cells hold no spaces in these tests)."""
    lines = [line.split() for line in table.strip().splitlines()]
    return {cells[0]: cells[1:] for cells in lines[1:]}


def fields_of(table: str) -> dict[str, str]:
    """A two-column table of field and value (field names hold single spaces)."""
    out = {}
    for line in table.strip().splitlines()[1:]:
        field, value = re.split(r"\s{2,}", line, maxsplit=1)
        out[field] = value
    return out


def create(url: str, *names: str) -> None:
    for name in names:
        assert httpx.put(f"{url}/v1/stream/{name}", headers=JSON).status_code == 201


def append(url: str, stream: str, *values: Any) -> str:
    r = httpx.post(f"{url}/v1/stream/{stream}", json=list(values))
    assert r.status_code == 204, r.text
    return r.headers["stream-next-offset"]


def consume(url: str, group: str, stream: str) -> list[Any]:
    """What a consumer of ``group`` reads now from its committed offset (and commits as it goes)."""
    with Consumer(url, group=group, streams=[stream], store=GroupOffsetStore(url), live=None) as consumer:
        return [m.value for m in consumer]


# ---------------------------------------------------------------------- help

LEAVES = [
    ("streams", "list"),
    ("streams", "describe"),
    ("groups", "list"),
    ("groups", "describe"),
    ("groups", "reset"),
    ("txn", "list"),
    ("txn", "describe"),
    ("txn", "abort"),
    ("sinks", "list"),
    ("sinks", "describe"),
    ("sinks", "reset"),
]


@pytest.mark.parametrize("command", ["streams", "groups", "txn", "sinks"])
def test_each_command_lists_its_actions(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "$ONCEFLOW_TOKEN" in out
    for cmd, action in LEAVES:
        if cmd == command:
            assert action in out


@pytest.mark.parametrize(("command", "action"), LEAVES, ids=[" ".join(leaf) for leaf in LEAVES])
def test_each_action_has_help(command: str, action: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, action, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: onceflow {command} {action}" in out and "--url" in out and "--json" in out
    assert "Needs " in " ".join(out.split())  # says which scope a guarded server wants


def test_an_action_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["txn"])
    assert exc.value.code == 2
    assert "ACTION" in capsys.readouterr().err


# ---------------------------------------------------------------------- streams


def test_streams_are_listed_and_described(run: Run, url: str) -> None:
    create(url, "st/a", "st/b")
    append(url, "st/a", 1, 2, 3)
    append(url, "st/a", 4)
    table = rows(run.ok("streams", "list", "--prefix", "st/"))
    assert list(table) == ["st/a", "st/b"]
    assert table["st/a"][:2] == ["application/json", "4"]  # content type, messages
    assert table["st/b"][1] == "0"
    listed = run.json("streams", "list", "--prefix", "st/")
    assert listed == httpx.get(f"{url}/v1/streams", params={"prefix": "st/"}).json()
    one = run.json("streams", "describe", "st/a")
    assert one == listed["streams"][0] and one["messages"] == 4
    fields = fields_of(run.ok("streams", "describe", "st/a"))
    assert fields["messages"] == "4" and fields["next offset"] == one["next_offset"]
    assert fields["forked from"] == "-" and fields["closed"] == "no"
    assert "no stream named 'st/c'" in run.fails("streams", "describe", "st/c")
    assert run.ok("streams", "list", "--prefix", "nothing/") == "no streams under 'nothing/'\n"


# ---------------------------------------------------------------------- groups


def test_group_lag_and_each_kind_of_reset(run: Run, url: str) -> None:
    create(url, "gr/in")
    first = append(url, "gr/in", "a")
    append(url, "gr/in", "b")
    assert consume(url, "gr/billing", "gr/in") == ["a", "b"]
    append(url, "gr/in", "c")
    # the time between b and c's successor: every batch before it was appended before it
    cut = int(time.time() * 1000) + 1
    while int(time.time() * 1000) <= cut:
        time.sleep(0.001)
    append(url, "gr/in", "d", "e")

    # lag: messages a consumer of the group has still to read
    assert rows(run.ok("groups", "list", "--prefix", "gr/")) == {"gr/billing": ["1", "3", "-"]}
    described = run.json("groups", "describe", "gr/billing")
    (stream,) = described["streams"]
    assert described["lag"] == 3 and stream["lag"] == 3 and stream["stream"] == "gr/in"
    assert rows(run.ok("groups", "describe", "gr/billing").split("\n", 1)[1])["gr/in"][2] == "3"

    # dry run: says where, changes nothing
    out = run.ok("groups", "reset", "gr/billing", "--to-earliest", "--dry-run")
    assert out.startswith("dry run:") and rows(out.split("\n", 1)[1])["gr/in"] == [stream["offset"], ZERO]
    assert run.json("groups", "describe", "gr/billing")["lag"] == 3

    out = run.ok("groups", "reset", "gr/billing", "--to-earliest")
    assert out.startswith("group gr/billing reset to earliest")
    assert rows(out.split("\n", 1)[1])["gr/in"] == [stream["offset"], ZERO]  # from, to
    assert consume(url, "gr/billing", "gr/in") == ["a", "b", "c", "d", "e"]

    reset = run.json("groups", "reset", "gr/billing", "--to-offset", first, "--stream", "gr/in")
    assert reset["offsets"] == {"gr/in": first}
    assert consume(url, "gr/billing", "gr/in") == ["b", "c", "d", "e"]

    iso = datetime.fromtimestamp(cut / 1000, UTC).isoformat()
    run.ok("groups", "reset", "gr/billing", "--to-time", iso)
    assert consume(url, "gr/billing", "gr/in") == ["d", "e"]
    run.ok("groups", "reset", "gr/billing", "--to-time", str(cut))  # milliseconds since the epoch
    assert consume(url, "gr/billing", "gr/in") == ["d", "e"]

    run.ok("groups", "reset", "gr/billing", "--to-earliest")
    run.ok("groups", "reset", "gr/billing", "--to-latest")
    append(url, "gr/in", "f")
    assert consume(url, "gr/billing", "gr/in") == ["f"]


def test_group_commands_refuse_clearly(run: Run, url: str) -> None:
    create(url, "gx/in")
    append(url, "gx/in", 1)
    assert consume(url, "gx/g", "gx/in") == [1]
    before = run.json("groups", "describe", "gx/g")
    assert "has committed no offsets" in run.fails("groups", "describe", "gx/none")
    assert "exactly one --stream" in run.fails("groups", "reset", "gx/g", "--to-offset", ZERO)
    assert "404 not_found: no stream named 'gx/nope'" in run.fails(
        "groups", "reset", "gx/g", "--to-earliest", "--stream", "gx/nope"
    )
    assert "not a record boundary" in run.fails(
        "groups", "reset", "gx/g", "--to-offset", "0000000000000000_0000000000000001", "--stream", "gx/in"
    )
    assert run.json("groups", "describe", "gx/g") == before
    code, _, err = run("groups", "reset", "gx/g", "--to-time", "last tuesday")
    assert code == 2 and "ISO 8601" in err
    code, _, err = run("groups", "reset", "gx/g")
    assert code == 2 and "one of the arguments --to-earliest --to-latest --to-offset --to-time is required" in err


# ---------------------------------------------------------------------- transactions


def test_a_hanging_transaction_is_listed_and_aborted_and_its_producer_fenced(run: Run, url: str) -> None:
    create(url, "tx/out")
    producer = TransactionalProducer(url, "tx/copier", timeout_ms=3_600_000)
    try:
        producer.append("tx/out", {"n": 1})
        producer.flush()  # written, never committed: the copier hangs

        assert rows(run.ok("txn", "list", "--open", "--prefix", "tx/"))["tx/copier"][:3] == ["ongoing", "0", "1"]
        (listed,) = run.json("txn", "list", "--open", "--prefix", "tx/")["transactions"]
        assert listed["open"] is True and listed["streams"] == ["tx/out"] and listed["open_ms"] >= 0
        assert run.json("txn", "describe", "tx/copier")["status"] == "ongoing"
        held = run.json("streams", "describe", "tx/out")
        assert held["stable_offset"] != held["next_offset"]  # the LSO is held

        out = run.ok("txn", "abort", "tx/copier")
        assert out.startswith("aborted transaction 1 of tx/copier (epoch 0); the id is now at epoch 1")
        after = run.json("txn", "describe", "tx/copier")
        assert after["status"] == "empty" and after["epoch"] == 1 and after["open"] is False

        with pytest.raises(OnceflowError) as fenced:
            producer.commit()
        assert fenced.value.status == 403
        assert httpx.get(f"{url}/v1/stream/tx/out", params={"offset": "-1"}).json() == []  # never visible
        freed = run.json("streams", "describe", "tx/out")
        assert freed["stable_offset"] == freed["next_offset"] and freed["open_transactions"] == 0
    finally:
        producer.close()

    assert "has no open transaction" in run.fails("txn", "abort", "tx/copier")
    assert run.ok("txn", "list", "--open", "--prefix", "tx/") == "no open transactions under 'tx/'\n"
    assert rows(run.ok("txn", "list", "--prefix", "tx/"))["tx/copier"][:3] == ["empty", "1", "0"]
    assert "404 not_found" in run.fails("txn", "describe", "tx/never")
    assert "was never initialised" in run.fails("txn", "abort", "tx/never")


def test_an_abort_can_be_pinned_to_the_transaction_listed(run: Run, url: str) -> None:
    create(url, "tp/out")
    producer = TransactionalProducer(url, "tp/w", timeout_ms=3_600_000)
    try:
        producer.append("tp/out", 1)
        producer.flush()
        assert "nothing was aborted" in run.fails("txn", "abort", "tp/w", "--epoch", "0", "--txn", "2")
        assert run.json("txn", "describe", "tp/w")["status"] == "ongoing"
        assert run.json("txn", "abort", "tp/w", "--epoch", "0", "--txn", "1")["aborted"] == {"epoch": 0, "txn": 1}
    finally:
        producer.close()


def test_a_group_and_an_idle_transactional_id_are_deleted(run: Run, url: str) -> None:
    """Issue 28, item 3: what a client creates can be removed by an operator."""
    create(url, "del/in", "del/out")
    append(url, "del/in", "a", "b")
    assert consume(url, "del/g", "del/in") == ["a", "b"]
    assert "del/g" in rows(run.ok("groups", "list", "--prefix", "del/"))
    assert run.ok("groups", "delete", "del/g") == "deleted group del/g: its offsets and member epoch are gone\n"
    assert run.ok("groups", "list", "--prefix", "del/") == "no groups under 'del/'\n"
    assert consume(url, "del/g", "del/in") == ["a", "b"]  # the group starts afresh
    assert "404 not_found" in run.fails("groups", "delete", "del/nobody")

    producer = TransactionalProducer(url, "del/copier", timeout_ms=3_600_000)
    try:
        producer.append("del/out", 1)
        producer.flush()
        assert "409 in_use" in run.fails("txn", "delete", "del/copier")  # its transaction is open
        producer.commit()
    finally:
        producer.close()
    assert run.ok("txn", "delete", "del/copier").startswith("deleted transactional id del/copier")
    assert "404 unknown_transactional_id" in run.fails("txn", "delete", "del/copier")
    again = TransactionalProducer(url, "del/copier")
    try:
        again.append("del/out", 2)
        again.commit()  # a new holder at a higher epoch: the stream takes it
    finally:
        again.close()
    assert httpx.get(f"{url}/v1/stream/del/out", params={"offset": "-1"}).json() == [1, 2]


# ---------------------------------------------------------------------- sinks


def test_sinks_are_listed_and_reset_on_purpose(run: Run, url: str) -> None:
    r = httpx.post(f"{url}/v1/sinks/sk/daily/commit", json={"batch": 4, "members": [], "query": "q-1"})
    assert r.status_code == 200, r.text
    assert rows(run.ok("sinks", "list", "--prefix", "sk/")) == {"sk/daily": ["4", "-", "q-1"]}
    assert run.json("sinks", "describe", "sk/daily") == {"sink": "sk/daily", "batch": 4, "owner": "q-1", "rows": None}
    assert "belongs to query q-1" in run.fails("sinks", "reset", "sk/daily", "--owner", "q-2")
    assert run.json("sinks", "list", "--prefix", "sk/")["sinks"] == [
        {"sink": "sk/daily", "batch": 4, "owner": "q-1", "rows": None}
    ]
    assert run.ok("sinks", "reset", "sk/daily", "--owner", "q-1").startswith("sink sk/daily reset")
    assert run.ok("sinks", "list", "--prefix", "sk/") == "no sinks under 'sk/'\n"
    code, _, err = run("sinks", "reset", "sk/daily")
    assert code == 2 and "--owner" in err


# ---------------------------------------------------------------------- failures and the guard


def test_a_server_that_is_not_there_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["txn", "list", "--url", down]) == 1
    out, err = capsys.readouterr()
    assert (
        out == "" and err.startswith(f"onceflow txn list: cannot reach the server at {down}") and err.count("\n") == 1
    )


def test_a_guarded_server_wants_the_admin_scope(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    guard = tmp_path / "guard.json"
    tokens = {
        "ops": [{"prefix": "", "scopes": ["read", "admin"]}],
        "tenant": [{"prefix": "", "scopes": ["read", "write"]}],
    }
    guard.write_text(json.dumps({"tokens": tokens}))
    srv = ServerProcess(tmp_path / "data", "--guard", str(guard))
    srv.start()
    try:
        run = Run(capsys, srv.url)
        monkeypatch.delenv("ONCEFLOW_TOKEN", raising=False)
        assert "set $ONCEFLOW_TOKEN" in run.fails("txn", "list")
        monkeypatch.setenv("ONCEFLOW_TOKEN", "tenant")
        assert "may not admin" in run.fails("txn", "list")
        assert run.ok("streams", "list") == "no streams\n"  # read is enough to list streams
        monkeypatch.setenv("ONCEFLOW_TOKEN", "ops")
        assert run.ok("txn", "list") == "no transactions\n"
        assert run.ok("groups", "list") == "no groups\n"
        assert run.ok("sinks", "list") == "no sinks\n"
    finally:
        srv.kill()


@pytest.mark.parametrize("as_json", [True, False])
def test_a_group_name_that_is_not_utf8_is_printed_escaped(as_json: bool) -> None:
    """A coordinator log from before names in bodies were checked can hold a group named with a
    lone surrogate; the server lists it (its JSON escapes it), but `onceflow groups` crashed printing
    it, as a table and with --json (UnicodeEncodeError, found by review). Run in a child whose
    stdout is a UTF-8 pipe, as when piped to jq or a file."""
    listing = {"groups": [{"group": "g\ud800", "streams": [], "lag": 0, "member_epoch": None}]}
    code = (
        "import argparse, json, sys\n"
        "from onceflow import admin\n"
        "class Listing:\n"
        f"    def get(self, path, params=None): return json.loads({json.dumps(json.dumps(listing))})\n"
        f"sys.exit(admin.groups_list(Listing(), argparse.Namespace(prefix='', json={as_json})))\n"
    )
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr.decode()
    out = run.stdout.decode("utf-8")
    assert "g\\ud800" in out  # the escape, as text
    if as_json:  # valid JSON, which reads back as the name the server holds
        assert json.loads(out)["groups"][0]["group"] == "g\ud800"
