"""The ``onceflow`` command."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging
import sys
from pathlib import Path

from .core.limits import StateLimits

__all__ = ["main"]


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _duration(text: str) -> int:
    """Seconds from e.g. ``7d``, ``12h``, ``30m``, ``90s`` or ``3600``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    value = int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    if value <= 0:
        raise ValueError(text)
    return value


def _positive_size(text: str) -> int:
    value = _size(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _size_or_off(text: str) -> int | None:
    """A size, or ``off`` (None)."""
    return None if text.strip().lower() == "off" else _positive_size(text)


_size_or_off.__name__ = "size (or off)"


def _lease_seconds(text: str) -> float:
    value = float(text)
    if not 1.0 <= value <= 300.0:  # NaN and infinities too: followers wait the leader's term
        raise ValueError(text)
    return value


_duration.__name__ = "duration"  # argparse names the type in its error: "invalid duration value"
_lease_seconds.__name__ = "term (1 to 300 seconds)"


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.05 <= value <= 3600.0:  # NaN and infinities too
        raise ValueError(text)
    return value


_seconds.__name__ = "seconds (0.05 to 3600)"


def _cold_reads(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 64:
        raise ValueError(text)
    return value


_cold_reads.__name__ = "count (1 to 64)"
_positive_size.__name__ = "size"


def _run(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.guard import GuardConfig, GuardConfigError
    from .server.http import HttpLimits
    from .server.run import serve

    try:
        guard = GuardConfig.from_file(args.guard) if args.guard else GuardConfig.from_env()
    except GuardConfigError as exc:
        print(f"onceflow serve: {exc}", file=sys.stderr)
        return 2
    try:
        limits = HttpLimits(
            header_timeout=args.header_timeout,
            idle_timeout=args.idle_timeout,
            body_timeout=args.body_timeout,
            min_body_rate=args.min_body_rate,
            write_timeout=args.write_timeout,
            max_connections=args.max_connections,
            max_header_bytes=args.max_header_bytes,
            max_headers=args.max_headers,
            body_buffer=args.body_buffer,
        )
    except ValueError as exc:
        print(f"onceflow serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.forward_buffer is not None and args.forward_buffer < args.max_body:
        print(
            f"onceflow serve: --forward-buffer {args.forward_buffer} is less than --max-body {args.max_body}: "
            "a follower could not pass the largest body on",
            file=sys.stderr,
        )
        return 2
    if args.store is not None:
        if not args.store.startswith(("postgresql://", "postgres://")) and "=" not in args.store:
            print(
                f"onceflow serve: --store {args.store!r} is not a PostgreSQL URL (postgresql://USER@HOST:PORT/DB)",
                file=sys.stderr,
            )
            return 2
        if args.http != "native":
            print("onceflow serve: --store runs on the native HTTP server only (leave --http out)", file=sys.stderr)
            return 2
    else:
        args.data.mkdir(parents=True, exist_ok=True)
    try:
        _run(
            serve(
                data=args.data,
                host=args.host,
                port=args.port,
                fsync=args.fsync,
                long_poll_timeout=args.long_poll_timeout,
                max_body_bytes=args.max_body,
                compress_min_bytes=args.compress_min,
                http=args.http,
                txn_timeout=args.txn_timeout,
                max_streams=args.max_streams,
                state_limits=StateLimits(
                    groups=args.max_groups,
                    transactional_ids=args.max_transactional_ids,
                    sinks=args.max_sinks,
                    subscriptions=args.max_subscriptions,
                ),
                max_open_files=args.max_open_files,
                log_level=args.log_level,
                guard=guard,
                limits=limits,
                webhook_targets=args.webhook_targets,
                retention_seconds=args.retention_age,
                retention_bytes=args.retention_bytes,
                segment_bytes=args.segment_bytes,
                retention_interval=args.retention_check_interval,
                metrics_allow=args.metrics_allow,
                store=args.store,
                advertise=args.advertise,
                lease_seconds=args.lease_seconds,
                forward=not args.no_forward,
                forward_buffer=args.forward_buffer,
                store_timeouts=(args.store_read_timeout, args.store_write_timeout),
                store_cold_reads=args.store_cold_reads,
            )
        )
    except KeyboardInterrupt:
        pass
    return 0


def _copy(args: argparse.Namespace) -> int:
    from .copy import run_copy

    return run_copy(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onceflow", description="A durable stream log with exactly-once semantics.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="run the server (Durable Streams protocol over a local segment log)",
        description="Serve streams at http://HOST:PORT/v1/stream/<name>, stored crash-safely under --data.",
    )
    s.add_argument(
        "--data", type=Path, default=Path("./onceflow-data"), help="data directory (default: ./onceflow-data)"
    )
    s.add_argument(
        "--store",
        metavar="URL",
        help="keep the streams in this PostgreSQL database instead of --data (a libpq URL, multi-host "
        "ones included: postgresql://USER@HOST1:PORT,HOST2:PORT/DB?target_session_attrs=read-write); "
        "any number of servers can share it, the one holding its lease serves (docs/ha.md)",
    )
    s.add_argument(
        "--advertise",
        metavar="URL",
        help="with --store: this server's URL as the other servers name it to clients "
        "(default: http://HOST:PORT as bound)",
    )
    s.add_argument(
        "--lease-seconds",
        type=_lease_seconds,
        default=3.0,
        metavar="S",
        help="with --store: the term of the store's lease; a follower takes over this long after it saw "
        "the leader's last renewal (default: 3: appends resume within about 5 s of a leader's death, "
        "10,000 streams included); a follower waits the longer of its own term and the leader's",
    )
    s.add_argument(
        "--store-read-timeout",
        type=_seconds,
        default=2.0,
        metavar="S",
        help="with --store: how long a read of the database made for the event loop (a read older than the "
        "memory cache, the retention sweep's) may take; past it the client is answered 503 and retries "
        "(default: 2)",
    )
    s.add_argument(
        "--store-cold-reads",
        type=_cold_reads,
        default=4,
        metavar="N",
        help="with --store: how many reads older than the memory cache wait for the database at once; "
        "the others wait for a turn (at most --store-read-timeout, then 503), and every other request "
        "is served meanwhile (default: 4)",
    )
    s.add_argument(
        "--store-write-timeout",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="with --store: how long a write of the database made for the event loop (a create, a delete, "
        "retention's removal of a segment) may take; past it its outcome is unknown, it is answered "
        "503 outcome_unknown and the leader steps down (default: 5; raise it for segments of millions "
        "of chunks)",
    )
    s.add_argument(
        "--no-forward",
        action="store_true",
        help="with --store: a server that does not lead answers 503 not_leader (naming the leader) instead "
        "of passing requests on to the leader",
    )
    s.add_argument(
        "--forward-buffer",
        type=_positive_size,
        default=None,
        metavar="BYTES",
        help="with --store: request body bytes a follower holds at once to pass on to the leader, all requests "
        "together, at least --max-body; a request waits up to 5 s for room, then gets 503 (default: --max-body)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument(
        "--port", type=int, default=4437, help="port (default: 4437, the protocol's port; 0 picks a free one)"
    )
    s.add_argument(
        "--fsync",
        choices=["always", "interval", "never"],
        default="always",
        help="always: acknowledge appends only after fsync, one fsync shared by concurrent appends (default); "
        "interval: fsync every second; never: leave it to the OS",
    )
    s.add_argument(
        "--long-poll-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="how long a long-poll or idle SSE read waits for data (default: 20)",
    )
    s.add_argument(
        "--max-body",
        type=_size,
        default=64 << 20,
        metavar="BYTES",
        help="largest request body accepted, e.g. 64MiB (default); larger bodies get 413, and so do compressed "
        "ones that decode to more",
    )
    s.add_argument(
        "--compress-min",
        type=_size_or_off,
        default=1 << 10,
        metavar="BYTES",
        help="smallest read answer sent compressed to a client that accepts gzip or zstd (Accept-Encoding), "
        "e.g. 1KiB (default); off: none is (docs/protocol.md, Compression)",
    )
    s.add_argument(
        "--txn-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="default timeout after which an open transaction is aborted (default: 60)",
    )
    s.add_argument(
        "--max-streams",
        type=int,
        default=100_000,
        metavar="N",
        help="most streams the server holds; creating one more gets 429 (default: 100000)",
    )
    defaults = StateLimits()
    for flag, default, what in (
        ("--max-groups", defaults.groups, "consumer groups"),
        (
            "--max-transactional-ids",
            defaults.transactional_ids,
            "transactional ids (those of sinks' tasks included)",
        ),
        ("--max-sinks", defaults.sinks, "Spark sinks"),
        ("--max-subscriptions", defaults.subscriptions, "subscriptions"),
    ):
        s.add_argument(
            flag,
            type=int,
            default=default,
            metavar="N",
            help=f"most {what} the server holds; creating one more gets 429 (default: {default}; "
            "docs/security.md, Limits)",
        )
    s.add_argument(
        "--max-open-files",
        type=int,
        default=None,
        metavar="N",
        help="most segment and log files kept open at once; idle ones are closed and reopened on use "
        "(default: a quarter of the open-file limit, which serve raises to its hard limit, at most 4096)",
    )
    s.add_argument(
        "--http",
        choices=["native", "uvicorn"],
        default="native",
        help="HTTP server: onceflow's own asyncio/httptools server (default) or uvicorn",
    )
    s.add_argument(
        "--guard",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSON file of bearer tokens (read/write scopes per name prefix, metrics for /metrics) and limits; "
        "default: $ONCEFLOW_GUARD if set, else no tokens and no limits (see docs/security.md)",
    )
    s.add_argument(
        "--webhook-targets",
        choices=["public", "loopback", "private"],
        default="public",
        help="where subscriptions may send webhooks: public addresses over https (default); also "
        "localhost and loopback addresses; also private networks and local names (docs/security.md)",
    )
    s.add_argument(
        "--metrics-allow",
        action="append",
        default=[],
        metavar="PREFIX",
        help="give streams, consumer groups and sink ids starting with PREFIX a label of their own in "
        "GET /metrics (repeatable; default: none, all names counted together; docs/operations.md)",
    )
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    r = s.add_argument_group(
        "retention",
        "the default for streams created without Stream-Retention-* headers (docs/operations.md, "
        '"Retention"): whole segments are deleted, oldest first, never data of an open transaction, '
        "of a stream with forks, or past the offset of a group the stream names",
    )
    r.add_argument(
        "--retention-age",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="delete data older than this, e.g. 7d, 12h, 30m or seconds (default: keep everything)",
    )
    r.add_argument(
        "--retention-bytes",
        type=_positive_size,
        default=None,
        metavar="BYTES",
        help="delete the oldest data while a stream holds more than this, e.g. 10GiB (default: no limit)",
    )
    r.add_argument(
        "--segment-bytes",
        type=_positive_size,
        default=64 << 20,
        metavar="BYTES",
        help="size at which a stream's log starts a new segment file, the unit retention deletes (default: 64MiB)",
    )
    r.add_argument(
        "--retention-check-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often retention looks for segments to delete (default: 10)",
    )
    h = s.add_argument_group(
        "HTTP limits",
        'connection management of the HTTP layer (docs/security.md, "HTTP layer"); '
        "with --http uvicorn only --idle-timeout and --max-connections apply",
    )
    h.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        metavar="N",
        help="open connections at most; one more is answered 503 and closed (default: 1000; lowered with "
        "a warning when the open-files limit cannot fit it)",
    )
    h.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a request's line and headers must arrive within this from its first byte, else 408 and "
        "close; a new connection that sends nothing for this long is closed (default: 10)",
    )
    h.add_argument(
        "--idle-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a keep-alive connection that has had no request for this long (default: 30)",
    )
    h.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="longest pause allowed inside a request body, and the time after which --min-body-rate "
        "applies; else 408 and close (default: 30)",
    )
    h.add_argument(
        "--min-body-rate",
        type=_size,
        default=1024,
        metavar="BYTES",
        help="bytes per second a request body must average once it has taken --body-timeout; "
        "0 for no minimum (default: 1KiB)",
    )
    h.add_argument(
        "--write-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="drop a connection whose client has not read any of a pending response for this long (default: 60)",
    )
    h.add_argument(
        "--max-header-bytes",
        type=_size,
        default=32 << 10,
        metavar="BYTES",
        help="request line plus header names and values at most; larger: 431 (default: 32KiB)",
    )
    h.add_argument(
        "--max-headers", type=int, default=100, metavar="N", help="request headers at most; more: 431 (default: 100)"
    )
    h.add_argument(
        "--body-buffer",
        type=_size,
        default=1 << 20,
        metavar="BYTES",
        help="request body bytes held per connection before the app reads them (incl. pipelined "
        "requests); above it the connection stops reading until the app catches up (default: 1MiB)",
    )
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser(
        "copy",
        help="copy streams to streams exactly once, in transactions (a transactional copier)",
        description="Read --input streams as consumer group --group and write each message to one of the "
        "--output streams (by CRC-32 of the message), in transactions that also commit the "
        "consumed offsets. Safe to kill and restart with the same --transactional-id.",
    )
    c.add_argument("--url", default="http://127.0.0.1:4437", help="server (default: http://127.0.0.1:4437)")
    c.add_argument("--input", action="append", required=True, metavar="STREAM", help="an input stream (repeatable)")
    c.add_argument("--output", action="append", required=True, metavar="STREAM", help="an output stream (repeatable)")
    c.add_argument("--transactional-id", required=True, help="stable id of this copier; a restart fences the old one")
    c.add_argument("--group", required=True, help="consumer group whose offsets are committed with the output")
    c.add_argument("--txn-size", type=int, default=750, help="messages per transaction (default: 750)")
    c.add_argument("--live", action="store_true", help="keep tailing the inputs instead of stopping when caught up")
    c.add_argument(
        "--max-read-bytes",
        type=_size,
        default=64 << 10,
        metavar="BYTES",
        help="bound each read of an input (default: 64KiB), which bounds a transaction's size",
    )
    c.add_argument(
        "--txn-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the server aborts a transaction of this copier left open longer than this (default: 60)",
    )
    c.add_argument(
        "--offset-reset",
        choices=["error", "earliest"],
        default="error",
        help="when retention deleted input the group had not copied yet: stop with an error naming the "
        "earliest offset kept (default), or go on from it, skipping what was deleted",
    )
    c.add_argument("--quiet", action="store_true", help="no progress output")
    c.set_defaults(func=_copy)

    from .demo import add_demo_parser

    add_demo_parser(sub)

    from .admin import add_admin_parsers  # streams, groups, txn, sinks: an operator's commands (docs/operations.md)

    add_admin_parsers(sub)

    if _tools_installed():
        # the dev tools (a separate distribution, tools/): imported by name, so that onceflow never
        # imports onceflow_tools statically (the layers contract in pyproject.toml checks that)
        importlib.import_module("onceflow_tools.cli").add_parsers(sub)
    else:
        for name in TOOL_COMMANDS:
            t = sub.add_parser(name, help="a dev tool, not installed (scripts/setup.sh dev or pip install -e tools)")
            t.set_defaults(func=_tools_missing)
    return p


TOOL_COMMANDS = ("bench", "chaos", "sim")
TOOLS_MISSING = (
    "the dev tools (onceflow_tools: bench, chaos, sim): install them with "
    "`scripts/setup.sh dev` or `pip install -e tools` from a checkout of onceflow"
)


def _tools_installed() -> bool:
    return importlib.util.find_spec("onceflow_tools") is not None


def _tools_missing(args: argparse.Namespace) -> int:
    print(f"onceflow {args.command} needs {TOOLS_MISSING}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in and args_in[0] in TOOL_COMMANDS and not _tools_installed():
        print(f"onceflow {args_in[0]} needs {TOOLS_MISSING}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
