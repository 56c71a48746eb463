"""``onceflow streams|groups|txn|sinks``: an operator's commands against a running server.

Each command is one or two HTTP requests to ``--url`` (the server's operator endpoints,
docs/operations.md), with ``$ONCEFLOW_TOKEN`` as the bearer token when set (a guarded server wants
``read`` on the streams listed, ``admin`` for the rest). The answer is printed as a table for people
(drawn with ``rich`` on a terminal, plain aligned columns in a pipe) or, with ``--json``, as the
server's JSON for scripts. Every failure (server unreachable, a refusal) is one line on stderr and
exit status 1; a usage error is argparse's, status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

from .client import OnceflowError
from .client.lowlevel import error_from_response, http_client, request_url

__all__ = ["DEFAULT_URL", "AdminClient", "add_admin_parsers", "parse_time"]

DEFAULT_URL = "http://127.0.0.1:4437"
COMMANDS = ("streams", "groups", "txn", "sinks")


class AdminClient:
    """The operator endpoints over HTTP: JSON in, JSON out, every failure an :class:`OnceflowError`
    whose message is one line."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._api = request_url(self.url)  # what requests are addressed to (the same URL for one server)
        self._http = http_client(self.url, timeout=timeout, token=token)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, params: dict[str, str] | None = None) -> Any:
        return self._send("GET", path, params=params)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._send("POST", path, body=body)

    def delete(self, path: str) -> None:
        self._send("DELETE", path)

    def _send(
        self, method: str, path: str, *, params: dict[str, str] | None = None, body: dict[str, Any] | None = None
    ) -> Any:
        try:
            resp = self._http.request(method, self._api + path, params=params, json=body)
        except httpx.HTTPError as exc:
            raise OnceflowError(f"cannot reach the server at {self.url}: {exc or type(exc).__name__}") from None
        if resp.status_code >= 300:
            err = error_from_response(resp)
            code = f" {err.code}" if err.code else ""
            raise OnceflowError(
                f"the server answered {resp.status_code}{code}: {err}", status=err.status, code=err.code
            )
        if resp.status_code == 204:
            return None
        try:
            return resp.json()
        except ValueError:
            raise OnceflowError(
                f"the server's answer to {method} {path} is not JSON; is {self.url} onceflow?"
            ) from None


def _path(name: str) -> str:
    """A name as a path segment (names may hold ``/``, which stays; anything else is escaped)."""
    return quote(name, safe="/")


def parse_time(text: str) -> int:
    """``--to-time``: milliseconds since the epoch, or an ISO 8601 date and time (``Z`` or an offset;
    without one, the local time zone of this machine)."""
    raw = text.strip()
    if raw.isdigit():
        return int(raw)
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither milliseconds since the epoch nor an ISO 8601 time such as 2026-01-31T14:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()  # the local time zone
    return int(when.timestamp() * 1000)


# ---------------------------------------------------------------------- output


def _printable(text: str) -> str:
    """``text`` as it can be written: a lone surrogate (a name in a coordinator log from before
    names in bodies were checked) is shown escaped (``\\ud800``) instead of failing the output."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _show_json(value: Any) -> None:
    print(_printable(json.dumps(value, indent=2, ensure_ascii=False)))


def _table(columns: Sequence[str], rows: Sequence[Sequence[object]], *, numeric: Sequence[str] = ()) -> None:
    """A table on stdout: drawn by ``rich`` on a terminal; plain aligned columns otherwise."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    tty = sys.stdout.isatty()
    table = Table(
        box=box.SIMPLE_HEAD if tty else None, show_edge=False, pad_edge=False, header_style="bold" if tty else ""
    )
    for col in columns:
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=not tty)
    for row in rows:
        table.add_row(*(Text(_cell(v)) for v in row))
    if tty:
        Console(highlight=False).print(table)
        return
    out = io.StringIO()
    Console(file=out, width=1 << 16, color_system=None, highlight=False).print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in out.getvalue().splitlines()))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return _printable(str(value))


def _fields(pairs: Sequence[tuple[str, object]]) -> None:
    """One object as a two-column table of field and value."""
    _table(["FIELD", "VALUE"], [(k, v) for k, v in pairs])


def _duration(ms: int | None) -> str | None:
    if ms is None:
        return None
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _when(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _exact(items: list[dict[str, Any]], key: str, name: str) -> dict[str, Any] | None:
    return next((item for item in items if item.get(key) == name), None)


# ---------------------------------------------------------------------- streams


def streams_list(c: AdminClient, args: argparse.Namespace) -> int:
    value = c.get("/v1/streams", {"prefix": args.prefix})
    if args.json:
        _show_json(value)
        return 0
    streams = value["streams"]
    if not streams:
        print(f"no streams{_under(args.prefix)}")
        return 0
    _table(
        ["STREAM", "CONTENT TYPE", "MESSAGES", "BYTES", "OPEN TXNS", "CLOSED"],
        [
            (s["name"], s["content_type"], s.get("messages"), s.get("bytes"), s.get("open_transactions"), s["closed"])
            for s in streams
        ],
        numeric=("MESSAGES", "BYTES", "OPEN TXNS"),
    )
    return 0


def streams_describe(c: AdminClient, args: argparse.Namespace) -> int:
    s = _exact(c.get("/v1/streams", {"prefix": args.name})["streams"], "name", args.name)
    if s is None:
        raise OnceflowError(f"no stream named {args.name!r}")
    if args.json:
        _show_json(s)
        return 0
    _fields(
        [
            ("stream", s["name"]),
            ("content type", s["content_type"]),
            ("created", _when(s.get("created_ms"))),
            ("closed", s["closed"]),
            ("messages", s.get("messages")),
            ("bytes", s.get("bytes")),
            ("start offset", s.get("start_offset")),
            ("stable offset", s["stable_offset"]),
            ("next offset", s["next_offset"]),
            ("open transactions", s.get("open_transactions")),
            ("producers", s.get("producers")),
            ("forked from", s.get("forked_from")),
            ("ttl (s)", s.get("ttl_seconds")),
            ("expires at", s.get("expires_at")),
            ("retention (s)", s.get("retention_seconds")),
            ("retention (bytes)", s.get("retention_bytes")),
            ("retention keeps groups", ", ".join(s.get("retention_keep_groups") or []) or None),
        ]
    )
    return 0


# ---------------------------------------------------------------------- groups


def groups_list(c: AdminClient, args: argparse.Namespace) -> int:
    value = c.get("/v1/groups", {"prefix": args.prefix})
    if args.json:
        _show_json(value)
        return 0
    groups = value["groups"]
    if not groups:
        print(f"no groups{_under(args.prefix)}")
        return 0
    _table(
        ["GROUP", "STREAMS", "LAG", "MEMBER EPOCH"],
        [(g["group"], len(g["streams"]), g["lag"], g["member_epoch"]) for g in groups],
        numeric=("STREAMS", "LAG", "MEMBER EPOCH"),
    )
    return 0


def groups_describe(c: AdminClient, args: argparse.Namespace) -> int:
    g = _exact(c.get("/v1/groups", {"prefix": args.group})["groups"], "group", args.group)
    if g is None:
        raise OnceflowError(f"group {args.group!r} has committed no offsets")
    if args.json:
        _show_json(g)
        return 0
    print(f"group {g['group']}: lag {_cell(g['lag'])} messages (member epoch {_cell(g['member_epoch'])})")
    if g["streams"]:
        _table(
            ["STREAM", "COMMITTED", "STABLE", "LAG", "LAG BYTES"],
            [(s["stream"], s["offset"], s["stable_offset"], s["lag"], s["lag_bytes"]) for s in g["streams"]],
            numeric=("LAG", "LAG BYTES"),
        )
    for s in g["streams"]:
        if s.get("offset_gone"):
            print(
                f"{s['stream']}: retention deleted the data at the committed offset (a consumer gets 410 "
                "offset_gone there); the lag counts what is kept"
            )
    if g.get("hidden_streams"):
        print(f"and {g['hidden_streams']} stream(s) this token may not read (not shown, not in the lag)")
    return 0


def groups_reset(c: AdminClient, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"dry_run": args.dry_run}
    if args.to_offset is not None:
        if len(args.stream or []) != 1:
            raise OnceflowError("--to-offset needs exactly one --stream: an offset belongs to one stream")
        body.update(to="offsets", offsets={args.stream[0]: args.to_offset})
    else:
        body["to"] = "earliest" if args.to_earliest else "latest" if args.to_latest else "time"
        if args.to_time is not None:
            body["time_ms"] = args.to_time
        if args.stream:
            body["streams"] = args.stream
    value = c.post(f"/v1/groups/{_path(args.group)}/reset", body)
    if args.json:
        _show_json(value)
        return 0
    if value["dry_run"]:
        print(f"dry run: group {value['group']} would move to {value['to']} as below; nothing was changed")
    else:
        print(f"group {value['group']} reset to {value['to']}")
    _table(
        ["STREAM", "FROM", "TO"],
        [(name, value["previous"].get(name), off) for name, off in value["offsets"].items()],
    )
    return 0


def groups_delete(c: AdminClient, args: argparse.Namespace) -> int:
    c.delete(f"/v1/groups/{_path(args.group)}")
    print(f"deleted group {args.group}: its offsets and member epoch are gone")
    return 0


# ---------------------------------------------------------------------- transactions


def txn_delete(c: AdminClient, args: argparse.Namespace) -> int:
    c.delete(f"/v1/txn/{_path(args.id)}")
    print(f"deleted transactional id {args.id}; initialised again, it begins at a higher epoch than any it had")
    return 0


def txn_list(c: AdminClient, args: argparse.Namespace) -> int:
    value = c.get("/v1/txn", {"prefix": args.prefix, "open": "true" if args.open else "false"})
    if args.json:
        _show_json(value)
        return 0
    txns = value["transactions"]
    if not txns:
        print(f"no {'open ' if args.open else ''}transactions{_under(args.prefix)}")
        return 0
    _table(
        ["TRANSACTIONAL ID", "STATUS", "EPOCH", "TXN", "OPEN FOR", "TIMEOUT", "STREAMS"],
        [
            (
                t["transactional_id"],
                t["status"],
                t["epoch"],
                t["txn"],
                _duration(t["open_ms"]),
                _duration(t["timeout_ms"]),
                ", ".join(t["streams"]),
            )
            for t in txns
        ],
        numeric=("EPOCH", "TXN", "OPEN FOR", "TIMEOUT"),
    )
    return 0


def _txn_fields(t: dict[str, Any]) -> list[tuple[str, object]]:
    """A transactional id's state (``GET /v1/txn/<id>``; how long one is open: ``txn list``)."""
    return [
        ("transactional id", t["transactional_id"]),
        ("producer id", t["producer_id"]),
        ("status", t["status"]),
        ("open", t.get("open")),
        ("epoch", t["epoch"]),
        ("transaction", t["txn"]),
        ("timeout", _duration(t["timeout_ms"])),
        ("streams", ", ".join(t["streams"])),
        ("groups", ", ".join(t.get("groups", []))),
    ]


def txn_describe(c: AdminClient, args: argparse.Namespace) -> int:
    t = c.get(f"/v1/txn/{_path(args.id)}")
    if args.json:
        _show_json(t)
    else:
        _fields(_txn_fields(t))
    return 0


def txn_abort(c: AdminClient, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.epoch is not None:
        body["epoch"] = args.epoch
    if args.txn is not None:
        body["txn"] = args.txn
    t = c.post(f"/v1/txn/{_path(args.id)}/force-abort", body)
    if args.json:
        _show_json(t)
        return 0
    done = t["aborted"]
    print(
        f"aborted transaction {done['txn']} of {t['transactional_id']} (epoch {done['epoch']}); the id is now at "
        f"epoch {t['epoch']}, so its producer is fenced and must init again"
    )
    _fields(_txn_fields(t))
    return 0


# ---------------------------------------------------------------------- sinks


def sinks_list(c: AdminClient, args: argparse.Namespace) -> int:
    value = c.get("/v1/sinks", {"prefix": args.prefix})
    if args.json:
        _show_json(value)
        return 0
    sinks = value["sinks"]
    if not sinks:
        print(f"no sinks{_under(args.prefix)}")
        return 0
    _table(
        ["SINK", "LAST BATCH", "ROWS", "OWNER (QUERY)"],
        [(s["sink"], s["batch"], s.get("rows"), s["owner"]) for s in sinks],
        numeric=("LAST BATCH", "ROWS"),
    )
    return 0


def sinks_describe(c: AdminClient, args: argparse.Namespace) -> int:
    s = c.get(f"/v1/sinks/{_path(args.sink)}")
    if args.json:
        _show_json(s)
    else:
        _fields(
            [
                ("sink", s["sink"]),
                ("last batch", s["batch"]),
                ("rows of that batch", s.get("rows")),
                ("owner (query)", s["owner"]),
            ]
        )
    return 0


def sinks_reset(c: AdminClient, args: argparse.Namespace) -> int:
    owner = None if args.no_owner else args.owner
    value = c.post(f"/v1/sinks/{_path(args.sink)}/reset", {"owner": owner})
    if args.json:
        _show_json(value)
    else:
        print(f"sink {value['sink']} reset: its batch ids start afresh and any query may write under it")
    return 0


def _under(prefix: str) -> str:
    return f" under {prefix!r}" if prefix else ""


# ---------------------------------------------------------------------- the parsers


def _run(fn: Callable[[AdminClient, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            with AdminClient(args.url) as client:
                return fn(client, args)
        except OnceflowError as exc:
            print(f"onceflow {args.command} {args.action}: {exc}", file=sys.stderr)
            return 1

    return run


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=DEFAULT_URL, help=f"the server (default: {DEFAULT_URL})")
    common.add_argument("--json", action="store_true", help="print the server's JSON answer (for scripts)")
    return common


def _subcommands(p: argparse.ArgumentParser) -> Any:
    return p.add_subparsers(dest="action", required=True, metavar="ACTION")


GUARD_NOTE = "A guarded server (serve --guard) gets $ONCEFLOW_TOKEN as the bearer token. See docs/operations.md."


def add_admin_parsers(sub: Any) -> None:
    """Add ``streams``, ``groups``, ``txn`` and ``sinks`` to the ``onceflow`` command's sub-commands."""
    common = _common()
    prefix = argparse.ArgumentParser(add_help=False)
    prefix.add_argument("--prefix", default="", help="only names starting with this (default: all)")

    s = _subcommands(
        sub.add_parser(
            "streams",
            help="list and describe streams on a server",
            description=f"List and describe the streams of a running server. {GUARD_NOTE}",
        )
    )
    p = s.add_parser(
        "list",
        parents=[common, prefix],
        help="streams with their messages, bytes and open transactions",
        description="List streams: content type, messages, bytes, open transactions, closed. Needs read on the prefix.",
    )
    p.set_defaults(func=_run(streams_list))
    p = s.add_parser(
        "describe",
        parents=[common],
        help="one stream in full",
        description="Show one stream: offsets (start, last stable, next), size, producers, fork source, "
        "expiry. Needs read on it.",
    )
    p.add_argument("name", help="the stream's name")
    p.set_defaults(func=_run(streams_describe))

    g = _subcommands(
        sub.add_parser(
            "groups",
            help="consumer groups: committed offsets, lag, and resets",
            description="Consumer groups of a running server: committed offsets and lag, and moving a group's "
            "offsets on purpose. Lag counts messages from the committed offset to the stream's last stable "
            f"offset (what a read_committed consumer can read now). {GUARD_NOTE}",
        )
    )
    p = g.add_parser(
        "list",
        parents=[common, prefix],
        help="groups with their total lag",
        description="List consumer groups with the number of streams they committed offsets in and their total "
        "lag in messages. Needs admin on the prefix.",
    )
    p.set_defaults(func=_run(groups_list))
    p = g.add_parser(
        "describe",
        parents=[common],
        help="one group's offsets and lag per stream",
        description="Show a group's committed offset, the stream's last stable offset and the lag (messages "
        "and bytes) in each stream. Needs admin on the group.",
    )
    p.add_argument("group", help="the group's name")
    p.set_defaults(func=_run(groups_describe))
    p = g.add_parser(
        "reset",
        parents=[common],
        help="move a group's offsets to earliest, latest, an offset or a time",
        description="Move a group's committed offsets in one reset commit, backwards or forwards: to the start "
        "of each stream, to its last stable offset, to an offset, or to the first message appended at or "
        "after a time. Without --stream, every stream the group has committed an offset in. Stop the "
        "group's consumers first: a running consumer keeps its own position and commits it again. "
        "Needs admin on the group and read on the streams it names.",
    )
    p.add_argument("group", help="the group's name")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true", help="the start of each stream (read it all again)")
    to.add_argument(
        "--to-latest",
        action="store_true",
        help="each stream's last stable offset (skip what is there now; nothing of an open transaction is lost)",
    )
    to.add_argument("--to-offset", metavar="OFFSET", help="an offset of the one --stream (as groups describe shows)")
    to.add_argument(
        "--to-time",
        type=parse_time,
        metavar="TIME",
        help="the first message appended at or after TIME: ISO 8601 (2026-01-31T14:00:00Z; no zone: local "
        "time) or milliseconds since the epoch",
    )
    p.add_argument(
        "--stream", action="append", metavar="STREAM", help="a stream to reset (repeatable; default: the group's)"
    )
    p.add_argument("--dry-run", action="store_true", help="show where the offsets would go; change nothing")
    p.set_defaults(func=_run(groups_reset))
    p = g.add_parser(
        "delete",
        parents=[common],
        help="forget a group: its offsets and member epoch",
        description="Delete a consumer group: its committed offsets and member epoch are forgotten, so a "
        "consumer of it starts by its offset reset policy. Refused (exit 1) while an open transaction "
        "carries offsets for it. Stop the group's consumers first: a running one commits again and so "
        "creates the group anew. Needs admin on the group.",
    )
    p.add_argument("group", help="the group's name")
    p.set_defaults(func=_run(groups_delete))

    t = _subcommands(
        sub.add_parser(
            "txn",
            help="transactions: list, describe, abort a hanging one",
            description=f"Transactional ids of a running server, and aborting a hanging transaction. {GUARD_NOTE}",
        )
    )
    p = t.add_parser(
        "list",
        parents=[common, prefix],
        help="transactional ids with status, epoch and how long the transaction is open",
        description="List transactional ids: status, epoch, transaction number, how long the open transaction "
        "has been open (since it began, or since the server's last start), timeout and streams. "
        "Needs admin on the prefix.",
    )
    p.add_argument("--open", action="store_true", help="only ids with a transaction open")
    p.set_defaults(func=_run(txn_list))
    p = t.add_parser(
        "describe",
        parents=[common],
        help="one transactional id",
        description="Show one transactional id's state: status, epoch, transaction number, timeout, streams "
        "and groups (how long its transaction has been open: txn list). Needs read on it.",
    )
    p.add_argument("id", help="the transactional id")
    p.set_defaults(func=_run(txn_describe))
    p = t.add_parser(
        "abort",
        parents=[common],
        help="abort a hanging transaction and fence its producer",
        description="Abort the open transaction of a transactional id now, as its timeout would: its data is "
        "never shown to read_committed readers, the streams' last stable offset moves on, and the id "
        "moves to a new epoch, so the producer that held it is refused (403) and must init again. "
        "Refused (exit 1) when nothing is open. Needs admin on the id.",
    )
    p.add_argument("id", help="the transactional id")
    p.add_argument("--epoch", type=int, help="abort only if the open transaction is of this epoch")
    p.add_argument("--txn", type=int, help="abort only if the open transaction has this number")
    p.set_defaults(func=_run(txn_abort))
    p = t.add_parser(
        "delete",
        parents=[common],
        help="forget an idle transactional id",
        description="Delete a transactional id that has no transaction open or being decided (txn abort "
        "first). A producer that still holds it is refused from then on; one that initialises it again "
        "begins at an epoch above every epoch it had. Needs admin on the id.",
    )
    p.add_argument("id", help="the transactional id")
    p.set_defaults(func=_run(txn_delete))

    k = _subcommands(
        sub.add_parser(
            "sinks",
            help="Spark sinks: list, describe, reset one on purpose",
            description=f"The exactly-once sinks of the Spark connector on a running server. {GUARD_NOTE}",
        )
    )
    p = k.add_parser(
        "list",
        parents=[common, prefix],
        help="sinks with their last committed batch and owning query",
        description="List sinks: the last batch committed and the query the sink belongs to. Needs admin on the prefix.",
    )
    p.set_defaults(func=_run(sinks_list))
    p = k.add_parser(
        "describe",
        parents=[common],
        help="one sink",
        description="Show one sink's last committed batch and query. Needs read on it.",
    )
    p.add_argument("sink", help="the sink id (the writer's sinkId option)")
    p.set_defaults(func=_run(sinks_describe))
    p = k.add_parser(
        "reset",
        parents=[common],
        help="forget a sink's batches and query on purpose",
        description="Forget a sink's last batch and query, so a query with a new checkpoint (or another "
        "query) can write under its id; batch ids start afresh. Stop its query first. The reset names "
        "the query it takes the sink from (sinks list shows it), so a stale reset is refused. Every "
        "open transaction of the sink's tasks is aborted. Needs admin on the sink id.",
    )
    p.add_argument("sink", help="the sink id")
    owner = p.add_mutually_exclusive_group(required=True)
    owner.add_argument("--owner", metavar="QUERY", help="the query the sink belongs to now")
    owner.add_argument("--no-owner", action="store_true", help="the sink belongs to no query")
    p.set_defaults(func=_run(sinks_reset))
