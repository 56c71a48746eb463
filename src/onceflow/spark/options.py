"""The connector's options, parsed once and checked with messages that say what to write instead."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..client.lowlevel import Coding, check_compression
from ..errors import OnceflowError
from ._http import Conn
from .protocol import WriterSettings, attempt_timeout

__all__ = ["OptionError", "Options"]

DEFAULT_URL = "http://127.0.0.1:4437"


class OptionError(OnceflowError, ValueError):
    """An option of ``format("onceflow")`` is missing or wrong."""


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

    @classmethod
    def parse(cls, raw: Mapping[str, str]) -> Options:
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
            max_records_per_trigger=_int(opts, "maxrecordspertrigger", None),
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
