"""The connector's options, parsed once and checked with messages that say what to write instead."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..client.lowlevel import Coding, check_compression
from ..errors import OnceflowError
from ._http import Conn
from .protocol import WriterSettings, attempt_timeout

__all__ = ["SINK_OPTIONS", "SOURCE_OPTIONS", "OptionError", "Options", "Role", "check_names"]

DEFAULT_URL = "http://127.0.0.1:4437"


class OptionError(OnceflowError, ValueError):
    """An option of ``format("onceflow")`` is missing or wrong."""


Role = Literal["source", "sink"]

# The options each side takes, as written in docs/spark.md. Spark hands a Python data source its
# options with lowercased names (a case-insensitive map), so they are matched case-insensitively.
_SHARED = ("url", "token", "requestTimeoutSeconds", "compression")
SOURCE_OPTIONS = (
    *_SHARED,
    "streams",
    "pattern",
    "isolation",
    "startingOffsets",
    "startingTimestamp",
    "startingOffsetsByTimestamp",
    "endingOffsets",
    "maxRecordsPerTrigger",
    "maxOffsetsPerTrigger",
    "maxBytesPerTrigger",
    "minOffsetsPerTrigger",
    "maxTriggerDelay",
    "maxRecordsPerPartition",
    "minPartitions",
    "valueType",
    "offsetReset",
    "failOnDataLoss",
    "group",
)
SINK_OPTIONS = (
    *_SHARED,
    "stream",
    "sinkId",
    "contentType",
    "transactionTimeoutMs",
    "batchId",
    "verifyReplay",
    "checkpointLocation",  # Spark's own: DataStreamWriter passes it (and queryName) to the sink
    "queryName",
)


def check_names(raw: Mapping[str, str], role: Role, extra: Sequence[str] = ()) -> None:
    """Refuse an option ``role`` does not take, naming the closest one it does: a misspelt limit
    (``maxRecordPerTrigger``) would otherwise be ignored and the query run unbounded. ``extra``:
    names a subclass of the data source takes besides (the demo's crash points)."""
    known = (*(SOURCE_OPTIONS if role == "source" else SINK_OPTIONS), *extra)
    other = SINK_OPTIONS if role == "source" else SOURCE_OPTIONS
    by_lower = {k.lower(): k for k in known}
    for name in raw:
        if name.lower() in by_lower:
            continue
        if name.lower() == "path":
            raise OptionError(
                f'format("onceflow") takes no path (got {raw[name]!r}): name the '
                + ('streams with .option("streams", ...)' if role == "source" else 'stream with .option("stream", ...)')
            )
        side = {k.lower() for k in other}
        if name.lower() in side:
            raise OptionError(
                f"option {name} is an option of the {'sink' if role == 'source' else 'source'}, not the {role}"
            )
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean {by_lower[close[0]]}?" if close else ""
        raise OptionError(f"unknown option {name} for the onceflow {role}{hint} (docs/spark.md lists the options)")


_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|min|h|d)?\s*$", re.IGNORECASE)
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(opts: Mapping[str, str], key: str, name: str, default: int) -> int:
    """A duration as Spark writes them: ``15m``, ``30s``, ``500ms``, ``1h``; a bare number is milliseconds."""
    raw = opts.get(key)
    if raw is None:
        return default
    m = _DURATION.match(raw)
    if m is None:
        raise OptionError(f"option {name} must be a duration like 15m, 30s or 500ms, got {raw!r}")
    return int(m.group(1)) * _UNIT_MS[(m.group(2) or "ms").lower()]


def _int(opts: Mapping[str, str], key: str, default: int | None, *, low: int = 1) -> int | None:
    raw = opts.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"option {key} must be an integer, got {raw!r}") from None
    if value < low:
        raise OptionError(f"option {key} must be at least {low}, got {value}")
    return value


def _bool(opts: Mapping[str, str], key: str, default: bool) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise OptionError(f"option {key} must be true or false, got {raw!r}")
    return raw.strip().lower() == "true"


def _timestamps(raw: str | None) -> dict[str, int] | None:
    """``startingOffsetsByTimestamp``: a JSON object of stream -> milliseconds since the epoch."""
    if raw is None:
        return None
    try:
        given = json.loads(raw)
    except ValueError:
        given = None
    if not isinstance(given, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in given.values()
    ):
        raise OptionError(
            "option startingOffsetsByTimestamp must be a JSON object of stream -> milliseconds since the epoch, "
            f'like {{"orders": 1767225600000}}, got {raw!r}'
        )
    return given


@dataclass(frozen=True)
class Options:
    url: str
    streams: tuple[str, ...]
    pattern: str | None
    isolation: str
    starting_offsets: str
    ending_offsets: str
    max_records_per_trigger: int | None
    max_records_per_partition: int
    request_deadline: float
    token: str | None = field(
        repr=False
    )  # bearer token for --guard (else $ONCEFLOW_TOKEN where the code runs); never printed
    # sink
    stream: str | None
    sink_id: str | None
    content_type: str
    transaction_timeout_ms: int
    batch_id: int | None
    verify_replay: bool = True
    offset_reset: str = "error"  # "earliest": read on from the earliest offset kept when retention overtook a read
    group: str | None = None  # a consumer group the source commits each finished micro-batch's end to
    compression: Coding | None = None  # gzip or zstd: the sink's appends and the source's reads (docs/spark.md)
    max_bytes_per_trigger: int | None = None  # stored bytes a micro-batch reads, about (docs/spark.md)
    min_records_per_trigger: int | None = None  # a micro-batch waits for this many rows...
    max_trigger_delay_ms: int = 15 * 60_000  # ...or this long since the last one (Kafka's default 15m)
    min_partitions: int | None = None  # split the ranges of a batch into at least this many tasks
    starting_timestamp: int | None = None  # ms since the epoch: every stream from its first record then
    starting_by_timestamp: Mapping[str, int] | None = None  # the same per stream

    @classmethod
    def parse(cls, raw: Mapping[str, str], role: Role | None = None, extra: Sequence[str] = ()) -> Options:
        """The options as Spark hands them over (names in any case). With ``role``, a name that
        side does not take (nor ``extra``) is an error (:func:`check_names`)."""
        if role is not None:
            check_names(raw, role, extra)
        opts = {k.lower(): v for k, v in raw.items()}
        streams_raw = opts.get("streams", "").strip()
        streams: tuple[str, ...] = ()
        if streams_raw:
            if streams_raw.startswith("["):
                try:
                    parsed = json.loads(streams_raw)
                except ValueError:
                    raise OptionError(
                        f"option streams is neither a JSON list nor comma-separated names: {streams_raw!r}"
                    ) from None
                if not isinstance(parsed, list) or not all(isinstance(s, str) and s for s in parsed):
                    raise OptionError("option streams must be a JSON list of stream names")
                streams = tuple(parsed)
            else:
                streams = tuple(s.strip() for s in streams_raw.split(",") if s.strip())
        isolation = opts.get("isolation", "read_committed")
        if isolation not in ("read_committed", "read_uncommitted"):
            raise OptionError(f"option isolation must be read_committed or read_uncommitted, got {isolation!r}")
        offset_reset = opts.get("offsetreset", "error")
        if offset_reset not in ("error", "earliest"):
            raise OptionError(f"option offsetReset must be error or earliest, got {offset_reset!r}")
        if "failondataloss" in opts:  # Kafka's spelling of the same choice
            fail = _bool(opts, "failondataloss", True)
            as_reset = "error" if fail else "earliest"
            if "offsetreset" in opts and as_reset != offset_reset:
                raise OptionError(
                    f"options failOnDataLoss={opts['failondataloss']} and offsetReset={offset_reset} disagree: "
                    f"failOnDataLoss=false is offsetReset=earliest, true is error; give one of them"
                )
            offset_reset = as_reset
        max_records = _int(opts, "maxrecordspertrigger", None)
        max_offsets = _int(opts, "maxoffsetspertrigger", None)
        if max_records is not None and max_offsets is not None and max_records != max_offsets:
            raise OptionError(
                f"options maxRecordsPerTrigger ({max_records}) and maxOffsetsPerTrigger ({max_offsets}) are one "
                "limit under two names; give one of them"
            )
        starting_by_timestamp = _timestamps(opts.get("startingoffsetsbytimestamp"))
        try:
            compression = check_compression(opts.get("compression") or None)
        except ValueError:
            raise OptionError(
                f"option compression must be gzip or zstd (or left out), got {opts['compression']!r}"
            ) from None
        sink_id = opts.get("sinkid")
        if sink_id is not None and (not sink_id or "/" in sink_id or any(ord(c) < 0x20 for c in sink_id)):
            raise OptionError(f"option sinkId must be a non-empty name without '/', got {sink_id!r}")
        return cls(
            url=opts.get("url", DEFAULT_URL).rstrip("/"),
            streams=streams,
            pattern=opts.get("pattern"),
            isolation=isolation,
            starting_offsets=opts.get("startingoffsets", "earliest"),
            ending_offsets=opts.get("endingoffsets", "latest"),
            max_records_per_trigger=max_records if max_records is not None else max_offsets,
            max_records_per_partition=_int(opts, "maxrecordsperpartition", 1_000_000) or 1_000_000,
            request_deadline=float(_int(opts, "requesttimeoutseconds", 120) or 120),
            token=opts.get("token") or None,
            stream=opts.get("stream"),
            sink_id=sink_id,
            content_type=opts.get("contenttype", "application/json"),
            transaction_timeout_ms=_int(opts, "transactiontimeoutms", 300_000) or 300_000,
            batch_id=_int(opts, "batchid", None, low=0),
            verify_replay=_bool(opts, "verifyreplay", True),
            offset_reset=offset_reset,
            group=opts.get("group") or None,
            compression=compression,
            max_bytes_per_trigger=_int(opts, "maxbytespertrigger", None),
            min_records_per_trigger=_int(opts, "minoffsetspertrigger", None),
            max_trigger_delay_ms=_duration_ms(opts, "maxtriggerdelay", "maxTriggerDelay", 15 * 60_000),
            min_partitions=_int(opts, "minpartitions", None),
            starting_timestamp=_int(opts, "startingtimestamp", None, low=0),
            starting_by_timestamp=starting_by_timestamp,
        )

    def connect(self) -> Conn:
        """A connection to the server these options name."""
        return Conn(
            self.url,
            deadline=self.request_deadline,
            timeout=attempt_timeout(self.request_deadline),  # several attempts fit in the deadline
            token=self.token,
            offset_reset=self.offset_reset,
            compression=self.compression,
        )

    def writer_settings(self, sink: str) -> WriterSettings:
        """What the sink's tasks and driver need, for sink (or write job) ``sink``."""
        return WriterSettings(
            url=self.url,
            sink=sink,
            content_type=self.content_type,
            transaction_timeout_ms=self.transaction_timeout_ms,
            request_deadline=self.request_deadline,
            verify_replay=self.verify_replay,
            compression=self.compression,
        )

    def check_source(self) -> None:
        if bool(self.streams) == (self.pattern is not None):
            raise OptionError(
                'give the streams to read with exactly one of .option("streams", "a,b") or .option("pattern", "prefix/")'
            )

    def _offsets(self, key: str, spec: str, ends: Mapping[str, str], default: str) -> dict[str, str]:
        if spec == "earliest":
            return dict.fromkeys(ends, "-1")
        if spec == "latest":
            return dict(ends)
        try:
            given = json.loads(spec)
        except ValueError:
            raise OptionError(
                f'option {key} must be "earliest", "latest" or a JSON object of stream -> offset, got {spec!r}'
            ) from None
        if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
            raise OptionError(f'option {key} must be a JSON object like {{"orders": "-1"}} (offsets are strings)')
        unknown = sorted(set(given) - set(ends))
        if unknown:
            raise OptionError(f"option {key} names streams this query does not read: {unknown}")
        out = {name: default if default != "end" else ends[name] for name in ends}
        for name, off in given.items():
            out[name] = ends[name] if off == "latest" else ("-1" if off == "earliest" else off)
        return out

    def starting(self, ends: Mapping[str, str]) -> dict[str, str]:
        return self._offsets("startingOffsets", self.starting_offsets, ends, "-1")

    def ending(self, ends: Mapping[str, str]) -> dict[str, str]:
        return self._offsets("endingOffsets", self.ending_offsets, ends, "end")
