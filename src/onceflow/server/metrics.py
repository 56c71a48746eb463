"""Prometheus metrics, scraped at ``GET /metrics`` (docs/operations.md lists every one).

Each :class:`~onceflow.server.app.App` keeps its own :class:`Metrics`, with a registry of its own
(never the client library's global one: a process may serve several brokers, as the tests do).
The figures come from three places, each where it is cheapest:

- per request, from :class:`~onceflow.server.instrument.Instrumented`, the outermost ASGI layer:
  request latency by route, status and error code; appends and their bytes, bytes read; live
  readers. A histogram step and a few additions per request, no parsing on the success path.
- from the storage layer, through the broker's :class:`~onceflow.storage.log.IoEvents` (this
  object is one of its observers): fsync latency, group-commit size, store errors. Per written
  group, not per request.
- from the broker's state, computed at scrape time by :class:`_Collector`: streams, open
  transactions and the oldest one's age, LSO lag, consumer-group lag, sinks' last batch, disk free.
  Nothing on the hot path.

Names are not labels by default: a stream, group or sink gets a label of its own only when it
starts with a prefix of the allow-list (``onceflow serve --metrics-allow PREFIX``); the others
share the empty label value (a sum for counters, the largest value for lags). Without an
allow-list those metrics have no name label at all, so the number of series does not grow with
the number of streams.
"""

from __future__ import annotations

import re
import shutil
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..core.broker import Broker
from ..core.txn import TxnStatus
from ..storage.position import parse_token

__all__ = ["Metrics", "STORE_OPS"]

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GROUP_BATCHES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GROUP_BYTES_BUCKETS = (512, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
STORE_OPS = ("write", "sync", "roll", "snapshot", "create")  # what IoObserver.failed names
OPEN_STATUSES = (TxnStatus.ONGOING, TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT)
MAX_CODES = 64  # distinct error-code label values; any further one is counted as "other"
_CODE = re.compile(r"[A-Za-z_]{1,40}")


class _Buckets:
    """One histogram's counts (``counts[i]``: observations in bucket ``i`` alone, the last one past
    every bound) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket holds values <= its bound
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, buckets = 0, []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        family.add_metric(labels, buckets, self.sum)


class _Traffic:
    """Appends, their bytes and bytes read for one stream label value."""

    __slots__ = ("append_bytes", "appends", "read_bytes")

    def __init__(self) -> None:
        self.appends = 0
        self.append_bytes = 0
        self.read_bytes = 0


class Metrics:
    """What ``/metrics`` shows for one broker: a registry of its own, and the calls that feed it.

    The figures fed per request or per written group are plain numbers added on the event loop
    (the only thread that feeds or scrapes them), with no lock per step as the client library's
    own counters and histograms take: they cost a third as much on the hot path (issue 19 counts
    microseconds per request). :class:`_Collector` shows them, with what it computes from the
    broker's state, as the library's metric families; the library encodes the scrape."""

    def __init__(self, broker: Broker, allow: Sequence[str] = ()) -> None:
        self.broker = broker
        self.allow = tuple(allow)
        self.requests: dict[tuple[str, str, str], _Buckets] = {}  # by (route, status, code)
        self._request_keys: dict[tuple[str, int, str], _Buckets] = {}
        self._codes: set[str] = set()
        self.traffic: dict[str, _Traffic] = {"": _Traffic()}  # by stream label value ("": not allow-listed)
        self.live_readers = 0
        self.fsync = _Buckets(FSYNC_BUCKETS)
        self.group_batches = _Buckets(GROUP_BATCHES_BUCKETS)
        self.group_bytes = _Buckets(GROUP_BYTES_BUCKETS)
        self.store_errors = dict.fromkeys(STORE_OPS, 0)
        # answers the native HTTP layer gives before the app sees a request (server/http.py)
        self.http_refusals: Counter[tuple[int, str]] = Counter()
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)  # the client library's standard process_* metrics
        broker.io.add(self)

    # ------------------------------------------------------------------ per request

    def request(self, route: str, status: int, code: str, seconds: float) -> None:
        """One request answered (``status`` 0: it ended with no answer started)."""
        key = (route, status, code)
        buckets = self._request_keys.get(key)
        if buckets is None:
            known = not code or code in self._codes
            if not known and len(self._codes) < MAX_CODES and _CODE.fullmatch(code):
                self._codes.add(code)
                known = True
            labels = (route, str(status) if status else "none", code if known else "other")
            buckets = self.requests.get(labels)
            if buckets is None:
                buckets = self.requests[labels] = _Buckets(LATENCY_BUCKETS)
            if known:  # a code past the cap is not remembered: every one of them is "other"
                self._request_keys[key] = buckets
        buckets.observe(seconds)

    def _traffic(self, stream: str) -> _Traffic:
        if not self.allow or not stream.startswith(self.allow):
            return self.traffic[""]
        t = self.traffic.get(stream)
        if t is None:
            if len(self.traffic) > 2 * len(self.broker.streams) + 16:  # amortized: labels of deleted streams go
                self.forget_deleted()
            t = self.traffic[stream] = _Traffic()
        return t

    def forget_deleted(self) -> None:
        """Drop the counters of streams that no longer exist: labels follow the streams there are
        (a stream created again under a name starts again at 0, as a restarted counter does)."""
        for name in [n for n in self.traffic if n and self.broker.get(n) is None]:
            del self.traffic[name]

    def appended(self, stream: str, nbytes: int) -> None:
        t = self._traffic(stream)
        t.appends += 1
        t.append_bytes += nbytes

    def read(self, stream: str, nbytes: int) -> None:
        self._traffic(stream).read_bytes += nbytes

    # ------------------------------------------------------------------ IoObserver (storage)

    def written(self, batches: int, nbytes: int, sync_seconds: float | None) -> None:
        self.group_batches.observe(batches)
        self.group_bytes.observe(nbytes)
        if sync_seconds is not None:
            self.fsync.observe(sync_seconds)

    def synced(self, seconds: float) -> None:
        self.fsync.observe(seconds)

    def failed(self, op: str) -> None:
        self.store_errors[op] = self.store_errors.get(op, 0) + 1

    # ------------------------------------------------------------------ the scrape

    def scrape(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition (OpenMetrics when the scraper asks for it) and its content type."""
        encode, content_type = choose_encoder(accept or "")
        self.forget_deleted()
        return encode(self.registry), content_type


def _histogram(name: str, doc: str, buckets: _Buckets) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=[])
    buckets.add_to(family, [])
    return family


class _Collector(Collector):
    """Every onceflow metric at scrape time: the numbers :class:`Metrics` keeps, and the gauges
    computed from the broker's state (on the event loop, like every other reader of that state)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.broker = metrics.broker
        self.allow = metrics.allow

    def _key(self, name: str) -> str:
        return name if name.startswith(self.allow) else ""

    def _per_name(self, metric: str, doc: str, label: str, values: dict[str, float]) -> GaugeMetricFamily:
        """``values`` by label value ("": the names not allowed, already reduced) as one family."""
        if not self.allow:
            return GaugeMetricFamily(metric, doc, value=values.get("", 0))
        family = GaugeMetricFamily(metric, doc, labels=[label])
        values.setdefault("", 0)
        for key in sorted(values):
            family.add_metric([_label(key)], values[key])
        return family

    def _counters(self) -> Iterator[Metric]:
        labels = ["stream"] if self.allow else None
        for metric, doc, field in (
            ("onceflow_appends", "Appends stored (duplicates not counted)", "appends"),
            ("onceflow_append_bytes", "Request body bytes of the appends stored", "append_bytes"),
            ("onceflow_read_bytes", "Body bytes of the read answers sent (200s)", "read_bytes"),
        ):
            if labels is None:
                yield CounterMetricFamily(metric, doc, value=getattr(self.metrics.traffic[""], field))
                continue
            family = CounterMetricFamily(metric, doc, labels=labels)
            traffic = self.metrics.traffic
            for key in sorted(traffic):
                family.add_metric([key], getattr(traffic[key], field))
            yield family

    def _fed(self) -> Iterator[Metric]:
        m = self.metrics
        requests = HistogramMetricFamily(
            "onceflow_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, by route, status and error code",
            labels=["route", "status", "code"],
        )
        for labels in sorted(m.requests):
            m.requests[labels].add_to(requests, list(labels))
        yield requests
        refused = CounterMetricFamily(
            "onceflow_http_refused",
            "Requests and connections the native HTTP layer answered itself, before the app saw them "
            "(408 timeouts, 414/431 oversized request heads, 400 unparsable requests, 503 over the "
            "connection cap), by status and error code",
            labels=["status", "code"],
        )
        for (status, code), n in sorted(m.http_refusals.items()):
            refused.add_metric([str(status), code], n)
        yield refused
        yield from self._counters()
        yield GaugeMetricFamily("onceflow_live_readers", "Long-poll and SSE reads open now", value=m.live_readers)
        yield _histogram(
            "onceflow_fsync_duration_seconds",
            "Time an fdatasync of a log took (a written group, or an interval sync)",
            m.fsync,
        )
        yield _histogram(
            "onceflow_group_commit_batches",
            "Batches written together in one group (one write, one fsync under --fsync always)",
            m.group_batches,
        )
        yield _histogram("onceflow_group_commit_bytes", "Bytes written together in one group", m.group_bytes)
        errors = CounterMetricFamily(
            "onceflow_store_errors", "I/O errors of the logs' write path, by operation", labels=["op"]
        )
        for op, n in m.store_errors.items():
            errors.add_metric([op], n)
        yield errors

    def collect(self) -> Iterator[Metric]:
        b = self.broker
        yield from self._fed()
        yield GaugeMetricFamily(
            "onceflow_streams",
            "Streams held (soft-deleted ones, kept while they have forks, included)",
            value=len(b.streams),
        )
        yield from self._transactions()
        yield self._per_name(
            "onceflow_lso_lag_records",
            "Records past the last stable offset: held back from read_committed readers by open transactions "
            '(the largest among the streams under stream="")',
            "stream",
            self._lso_lags(),
        )
        yield self._per_name(
            "onceflow_consumer_group_lag_records",
            "Records a consumer group has yet to commit, summed over its streams, up to each stream's last stable "
            'offset (the largest among the groups under group="")',
            "group",
            self._group_lags(),
        )
        sinks = GaugeMetricFamily(
            "onceflow_sink_last_batch", "The last batch a sink committed (allow-listed sink ids only)", labels=["sink"]
        )
        for sink, state in sorted(b.coordinator.sinks.items()):
            if self.allow and sink.startswith(self.allow) and state.batch is not None:
                sinks.add_metric([_label(sink)], state.batch)
        yield sinks
        try:
            usage = shutil.disk_usage(b.data_dir)
        except OSError:
            return
        yield GaugeMetricFamily(
            "onceflow_disk_free_bytes",
            "Bytes free for the server on the data directory's file system",
            value=usage.free,
        )
        yield GaugeMetricFamily(
            "onceflow_disk_size_bytes", "Size of the data directory's file system in bytes", value=usage.total
        )

    def _lso_lags(self) -> dict[str, float]:
        """LSO lag by label value. Only a stream that a transaction still open wrote to, or a fork
        of one (whose range before the fork point that transaction may hold back), can lag: a
        scrape touches those, not every stream (a walk over 100,000 streams' state would hold
        the event loop for a good part of a second). Allow-listed names are shown at 0 too."""
        b = self.broker
        allow = self.allow
        lso: dict[str, float] = {"": 0}
        if allow:
            lso.update((name, 0) for name in b.streams if name.startswith(allow))
        todo = [
            s
            for meta in b.coordinator.txns.values()
            if meta.status in OPEN_STATUSES
            for s in (b.streams.get(name) for name in meta.streams)
            if s is not None
        ]
        seen: set[str] = set()
        while todo:
            s = todo.pop()
            if s.name in seen:
                continue
            seen.add(s.name)
            todo.extend(s.children)
            if s.meta.soft_deleted:
                continue
            key = s.name if allow and s.name.startswith(allow) else ""
            lso[key] = max(lso[key] if key in lso else 0, s.tail.offset - s.stable().offset)
        return lso

    def _transactions(self) -> Iterator[Metric]:
        coord = self.broker.coordinator
        started = [m.started for m in coord.txns.values() if m.status in OPEN_STATUSES]
        yield GaugeMetricFamily(
            "onceflow_open_transactions", "Transactions begun and not yet completed", value=len(started)
        )
        age = coord.clock.monotonic() - min(started) if started else 0.0
        yield GaugeMetricFamily(
            "onceflow_oldest_open_transaction_age_seconds",
            "How long the oldest open transaction has been open (0: none; its timeout restarts with the server)",
            value=max(0.0, age),
        )

    def _group_lags(self) -> dict[str, float]:
        b = self.broker
        lags: dict[str, float] = {}
        for group, offsets in b.coordinator.groups.items():
            lag = 0
            for stream, token in offsets.items():
                s = b.streams.get(stream)
                at = parse_token(token)
                if s is None or s.meta.soft_deleted or at is None:
                    continue
                # as GET /v1/groups counts it: from the earliest offset kept when retention deleted
                # the committed one, nothing for an offset past the tail (not one of this stream's)
                at = max(at, s.earliest, key=lambda p: p.pos)
                tail = s.tail
                if at.pos <= tail.pos and at.offset <= tail.offset:
                    lag += max(0, s.stable().offset - at.offset)
            key = self._key(group) if self.allow else ""
            lags[key] = max(lags.get(key, 0), lag)
        return lags


def _label(name: str) -> str:
    """A name as a label value the scrape can encode: a lone surrogate (a group named in a JSON
    body before names there were checked, still in the coordinator log) is written escaped
    (``\\ud800``), not left to make every later scrape fail."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")
