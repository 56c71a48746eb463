"""Subscriptions: durable cursors over sets of streams that wake workers (PROTOCOL.md sections 6-7).

A subscription links streams (explicitly, or by a glob ``pattern`` over stream names) and keeps one
acknowledged offset per linked stream. When a linked stream has data past its acknowledged offset
and no wake is in flight, the subscription issues a *wake*: the generation (a fencing counter) goes
up by one and the wake gets a fresh ``wake_id``. A webhook subscription POSTs the wake, signed with
the server's Ed25519 key, to its URL; a pull-wake subscription appends a wake event to its wake
stream, and workers race to *claim* it. Whoever holds the wake acks offsets, heartbeats and finally
finishes (``done``) or releases; a lease of ``lease_ttl_ms`` bounds how long a silent holder keeps it.
Requests carrying a stale generation or wake id are fenced.

This module knows no HTTP serving: ``onceflow.server.subscriptions`` parses requests and maps
:class:`SubscriptionError` to responses. Webhook POSTs go through an injected :data:`Poster`.

State lives under ``<data>/subscriptions/``: one JSON file per subscription (replaced atomically,
fsynced under the ``always`` policy), the Ed25519 signing key and the HMAC key of wake tokens, so a
restart keeps subscriptions, cursors, generations, leases (as wall-clock deadlines) and the webhook
retry schedule, and tokens issued before the restart stay valid. Every file is read and written
through the broker's :class:`~onceflow.storage.fs.FileSystem` (``broker.fs``), never the OS directly,
so the state lives wherever the broker's streams do.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import random
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..errors import OnceflowError
from ..storage.fs import OutcomeUnknown
from ..storage.log import InvalidPosition, StreamLog
from ..storage.position import ZERO, Position, parse_token
from .broker import Broker, StreamState
from .locks import KeyedLocks
from .refusal import Refusal
from .subscription_config import (
    BEFORE_FIRST,
    DEFAULT_LEASE_TTL_MS,
    MAX_LEASE_TTL_MS,
    MAX_STREAMS,
    MAX_WORKER,
    MIN_LEASE_TTL_MS,
    Config,
    SubscriptionError,
    SubscriptionType,
    WakeReply,
    WebhookTargets,
    _invalid,
    address_kind,
    allowed_target,
    glob_match,
    glob_prefix,
    is_public_address,
    normalize_path,
    parse_config,
    parse_wake_reply,
    unwrap_ipv4,
    validate_id,
    validate_webhook_url,
)

__all__ = [
    "DEFAULT_LEASE_TTL_MS",
    "MAX_LEASE_TTL_MS",
    "MIN_LEASE_TTL_MS",
    "Config",
    "DeliveryError",
    "Poster",
    "Subscription",
    "SubscriptionError",
    "Subscriptions",
    "WakeReply",
    "WebhookTargets",
    "address_kind",
    "allowed_target",
    "glob_match",
    "glob_prefix",
    "is_public_address",
    "parse_config",
    "parse_wake_reply",
    "unwrap_ipv4",
    "validate_webhook_url",
]

log = logging.getLogger("onceflow.subscriptions")

RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
RETRY_JITTER = 0.2
_FILE_VERSION = 1

Poster = Callable[[str, bytes, dict[str, str], float], Awaitable[tuple[int, bytes]]]
"""``(url, body, headers, timeout seconds) -> (status, response body)``; raises :class:`DeliveryError`."""


class DeliveryError(OnceflowError):
    """A webhook POST did not get an HTTP answer (refused, timed out, resolved to a private address)."""


def _unstored(what: str, exc: BaseException) -> SubscriptionError:
    """The refusal of a change whose write failed (``exc``): "not stored", or, when the store could
    not learn whether it was (a lost answer to COMMIT), said to be unknown: never "not stored" for
    state a later read may show."""
    if isinstance(exc, OutcomeUnknown):
        return SubscriptionError(
            Refusal.SUBSCRIPTION_OUTCOME_UNKNOWN,
            f"whether {what} was stored is unknown: it may have been ({exc}); send the request again",
        )
    return SubscriptionError(Refusal.SUBSCRIPTION_UNAVAILABLE, f"{what} could not be stored: {exc}")


def _not_found(sid: str) -> SubscriptionError:
    return SubscriptionError(Refusal.SUBSCRIPTION_NOT_FOUND, f"no subscription with id {sid!r}")


def _fenced(message: str, generation: int) -> SubscriptionError:
    return SubscriptionError(Refusal.GENERATION_FENCED, message, generation=generation)


def _iso(seconds: float) -> str:
    """``seconds`` since the epoch as an ISO 8601 time in UTC, to the millisecond."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ---------------------------------------------------------------------- state


@dataclass(slots=True)
class Link:
    """One linked stream and its cursor."""

    path: str
    explicit: bool = False
    glob: bool = False
    acked: Position | None = None  # last processed offset; None: nothing yet ("-1")
    born: int | None = None  # created_ms of the stream the cursor belongs to; None: not seen yet

    @property
    def link_type(self) -> str:
        return "explicit" if self.explicit else "glob"


@dataclass(frozen=True, slots=True)
class LinkState:
    """One linked stream of a subscription as its answers report it (not the client's StreamInfo)."""

    path: str
    link_type: str
    acked: Position | None
    tail: Position | None  # None: the stream does not exist (now)
    pending: bool

    def to_json(self, *, with_tail: bool) -> dict[str, object]:
        acked = self.acked.token() if self.acked is not None else BEFORE_FIRST
        out: dict[str, object] = {"path": self.path, "link_type": self.link_type, "acked_offset": acked}
        if with_tail:
            out["tail_offset"] = self.tail.token() if self.tail is not None else acked
            out["has_pending"] = self.pending
        return out


@dataclass(slots=True, eq=False)
class Subscription:
    id: str
    uid: str  # distinguishes a re-created subscription of the same id (its tokens are not ours)
    config: Config
    config_hash: str
    created_at: str
    base_url: str  # the stream root URL the creator used, for callback URLs
    links: dict[str, Link] = field(default_factory=dict)
    generation: int = 0
    wake_id: str | None = None
    trigger: str | None = None  # the stream named in the pull-wake event
    snapshot: dict[str, Position] = field(default_factory=dict)  # tails a webhook wake carried
    holder: str | None = None  # the pull-wake worker holding the wake
    lease_deadline: float | None = None  # wall clock; a held wake is taken back after it
    announced: bool = False  # the wake event is written / the webhook was delivered
    status: Literal["active", "failed"] = "active"
    attempts: int = 0  # failed webhook deliveries in a row
    next_attempt_at: float | None = None  # wall clock of the next webhook retry
    timer: asyncio.TimerHandle | None = None
    delivering: str | None = None  # the wake whose webhook POST is in flight
    announcing: str | None = None  # the wake whose wake event is being written

    @property
    def type(self) -> SubscriptionType:
        return self.config.type

    def to_file(self) -> dict[str, Any]:
        return {
            "v": _FILE_VERSION,
            "id": self.id,
            "uid": self.uid,
            "config": self.config.to_json(),
            "config_hash": self.config_hash,
            "created_at": self.created_at,
            "base_url": self.base_url,
            "links": [
                {
                    "path": k.path,
                    "explicit": k.explicit,
                    "glob": k.glob,
                    "acked": k.acked.token() if k.acked is not None else None,
                    "born": k.born,
                }
                for k in self.links.values()
            ],
            "generation": self.generation,
            "wake_id": self.wake_id,
            "trigger": self.trigger,
            "snapshot": {p: at.token() for p, at in self.snapshot.items()},
            "holder": self.holder,
            "lease_deadline": self.lease_deadline,
            "announced": self.announced,
            "status": self.status,
            "attempts": self.attempts,
            "next_attempt_at": self.next_attempt_at,
        }

    @staticmethod
    def from_file(raw: dict[str, Any]) -> Subscription:
        if raw.get("v") != _FILE_VERSION:
            raise ValueError(f"unknown subscription file version {raw.get('v')!r}")

        def pos(token: str | None) -> Position | None:
            if token is None:
                return None
            at = parse_token(token)
            if at is None:
                raise ValueError(f"bad offset {token!r}")
            return at

        sub = Subscription(
            id=raw["id"],
            uid=raw["uid"],
            config=Config.from_json(raw["config"]),
            config_hash=raw["config_hash"],
            created_at=raw["created_at"],
            base_url=raw["base_url"],
        )
        for k in raw["links"]:
            sub.links[k["path"]] = Link(k["path"], bool(k["explicit"]), bool(k["glob"]), pos(k["acked"]), k["born"])
        sub.generation = int(raw["generation"])
        sub.wake_id = raw["wake_id"]
        sub.trigger = raw["trigger"]
        sub.snapshot = {p: at for p, t in raw["snapshot"].items() if (at := pos(t)) is not None}
        sub.holder = raw["holder"]
        sub.lease_deadline = raw["lease_deadline"]
        sub.announced = bool(raw["announced"])
        sub.status = "failed" if raw["status"] == "failed" else "active"
        sub.attempts = int(raw["attempts"])
        sub.next_attempt_at = raw["next_attempt_at"]
        return sub


# ---------------------------------------------------------------------- the manager


class Subscriptions:
    """Every subscription of one broker: state, cursors, wakes, leases and webhook retries.

    All methods run on the broker's event loop. Request methods change the in-memory state without
    awaiting in between, then wait until it is on disk; background work (deliveries, wake events,
    lease expiry) runs as tasks and timers.
    """

    def __init__(self, broker: Broker, poster: Poster, *, rng: random.Random | None = None) -> None:
        self.broker = broker
        self.poster = poster
        # the broker's clocks (wall clock: lease deadlines, retry times, wake timestamps) and a
        # source of jitter: the simulator gives simulated time and a seeded random
        self.clock = broker.clock
        self.rng = rng if rng is not None else random.Random()  # noqa: S311 - jitter, not security
        self.fs = broker.fs  # every file of the state goes through it (see the module docstring)
        self.directory = broker.data_dir / "subscriptions"
        self.subs: dict[str, Subscription] = {}
        self._by_stream: dict[str, set[str]] = {}  # stream -> ids linking it
        self._by_wake: dict[str, set[str]] = {}  # wake stream -> ids writing to it
        self._patterns: dict[str, tuple[str, ...]] = {}  # id -> pattern segments
        self._watched: dict[str, StreamLog] = {}  # streams whose log calls us on every durable append
        self._seen: dict[str, StreamLog] = {}  # streams already matched against every pattern
        self._dirty: set[str] = set()
        broker.on_delete.append(self._forget_stream)
        self._drain_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._writes: set[asyncio.Task[None]] = set()  # background state writes (never cancelled)
        self._locks = KeyedLocks()  # by subscription id, while its state is being stored
        self._version: dict[str, int] = {}
        self._saved: dict[str, int] = {}
        self._key: Ed25519PrivateKey | None = None
        self._jwk: dict[str, str] = {}
        self._token_key: bytes | None = None
        self._dirs_durable = False  # subscriptions/ and subscriptions/subs exist and their names are synced
        self._started = False
        self._closing = False
        self._loaded: list[Subscription] | None = None  # read from disk (load), for start
        self._changed_before_start: set[str] = set()  # Streams changed before start could read the state.

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Read the subscriptions on disk, for :meth:`start` (which reads them itself if this was not
        called). It only reads, so a worker thread may run it (the PostgreSQL store's leader does:
        there each file is a query, and on the event loop its wait would be bounded). A file that
        does not parse is skipped with an error logged; one that cannot be *read* (the store failed
        or timed out) raises ``OSError``: skipped, the subscription would be answered 404 and a
        client's PUT would write over its stored state."""
        if self._loaded is not None:
            return
        subs_dir = self.directory / "subs"
        try:
            names = self.fs.listdir(subs_dir)
        except (FileNotFoundError, NotADirectoryError):
            names = []  # no subscription was ever stored
        loaded: list[Subscription] = []
        for name in sorted(n for n in names if n.endswith(".json")):  # not the ``.json.tmp`` of a cut write
            f = subs_dir / name
            raw = self.fs.read_bytes(f)
            try:
                loaded.append(Subscription.from_file(json.loads(raw)))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("skipping subscription file %s, which does not parse: %s", f, exc)
        self._loaded = loaded

    def start(self) -> None:
        """Load the subscriptions on disk (:meth:`load`) and resume their wakes, leases and
        retries. Idempotent."""
        if self._started or self._closing:
            return
        self.load()
        self._started = True
        assert self._loaded is not None
        for sub in self._loaded:
            self.subs[sub.id] = sub
            self._index(sub)
            self._version[sub.id] = self._saved[sub.id] = 0
        for sub in self.subs.values():
            for link in list(sub.links.values()):
                self._refresh(sub, link)
            self._resume(sub)
        changed, self._changed_before_start = self._changed_before_start, set()
        for name in sorted(changed):
            self._process(name)

    def try_start(self) -> bool:
        """:meth:`start`, for a caller that cannot answer with its failure (a stream change, whose
        request has its answer; the start an app schedules when it is made): False, logged, when
        the store could not read the subscriptions. The next stream change or subscription request
        tries again."""
        try:
            self.start()
        except OSError as exc:
            log.warning("the subscriptions could not be read yet (the next change or request tries again): %s", exc)
            return False
        return True

    def _resume(self, sub: Subscription) -> None:
        if sub.config.wake_stream is not None:
            ws = self._live(sub.config.wake_stream)
            if ws is not None:
                self._watch(ws)
        if sub.wake_id is None:
            self._maybe_wake(sub)
            return
        if sub.type == "webhook" and not sub.announced and sub.next_attempt_at is None:
            self._spawn(self._deliver(sub.id, sub.uid, sub.wake_id))
        elif sub.type == "pull-wake" and not sub.announced and sub.holder is None:
            self._spawn(self._announce(sub.id, sub.uid, sub.wake_id))
        self._arm(sub)

    async def close(self) -> None:
        """Stop timers and background work (state is already on disk)."""
        self._closing = True
        for sub in self.subs.values():
            if sub.timer is not None:
                sub.timer.cancel()
                sub.timer = None
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()  # deliveries and wake events; a restart re-sends what was cut short
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        for sid in [s for s, v in self._version.items() if v > self._saved.get(s, -1)]:
            try:
                await self._persist(sid)
            except (OSError, RuntimeError) as exc:
                log.error("could not store subscription %r on close: %s", sid, exc)

    @property
    def closing(self) -> bool:
        return self._closing or self.broker.closing

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self.closing:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self.closing:
            log.error("subscription background work failed: %r", exc, exc_info=exc)

    # ------------------------------------------------------------------ keys and tokens

    def _load_or_create(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The key file ``name``, made by ``make`` and stored (synced, owner-only) if missing."""
        path = self.directory / name
        try:
            return self.fs.read_bytes(path)
        except FileNotFoundError:
            pass
        self._make_dirs(durable=True)
        data = make()
        self.fs.replace_file(path, data, mode=0o600)
        return data

    def _make_dirs(self, *, durable: bool) -> None:
        """Create ``subscriptions/subs`` (parents too); with ``durable``, also sync the directories
        that hold the two new names, since a name is durable only once its directory is synced (the
        files' own syncs cover the names inside them). May run in several executor threads at once:
        every step is idempotent."""
        if self._dirs_durable:
            return
        self.fs.mkdir(self.directory / "subs")
        if durable:
            self.fs.sync_dir(self.directory)  # the name subs
            self.fs.sync_dir(self.broker.data_dir)  # the name subscriptions
            self._dirs_durable = True

    def signing_key(self) -> Ed25519PrivateKey:
        """The webhook signing key, created (and kept in the data directory) on first use."""
        if self._key is None:
            pem = self._load_or_create(
                "webhook-ed25519.pem",
                lambda: Ed25519PrivateKey.generate().private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                ),
            )
            key = serialization.load_pem_private_key(pem, password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError("the webhook signing key file does not hold an Ed25519 key")
            raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            x = _b64url(raw)
            # RFC 7638 thumbprint: the required members in lexicographic order, no whitespace
            thumb = hashlib.sha256(json.dumps({"crv": "Ed25519", "kty": "OKP", "x": x}, separators=(",", ":")).encode())
            self._jwk = {
                "kty": "OKP",
                "crv": "Ed25519",
                "kid": "ds_" + _b64url(thumb.digest()),
                "use": "sig",
                "alg": "EdDSA",
                "x": x,
            }
            self._key = key
        return self._key

    @property
    def kid(self) -> str:
        self.signing_key()
        return self._jwk["kid"]

    def jwks(self) -> dict[str, list[dict[str, str]]]:
        self.signing_key()
        return {"keys": [dict(self._jwk)]}

    def sign(self, body: bytes, now: float | None = None) -> str:
        """The ``Webhook-Signature`` header: Ed25519 over ``<unix seconds>.<body>``."""
        key = self.signing_key()
        ts = int(self.clock.time() if now is None else now)
        sig = key.sign(f"{ts}.".encode() + body)
        return f"t={ts},kid={self._jwk['kid']},ed25519={_b64url(sig)}"

    def _tokens(self) -> bytes:
        if self._token_key is None:
            self._token_key = self._load_or_create("token.key", lambda: secrets.token_bytes(32))
        return self._token_key

    def _token_fields(self, token: str) -> list[str] | None:
        """The claims of a wake token this server issued (its MAC checks out), else None.
        Creates no key: before the first token is issued, no token is valid."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != "v1":
            return None
        if self._token_key is None and not self.fs.exists(self.directory / "token.key"):
            return None
        try:
            claims, mac = _b64url_decode(parts[1]), _b64url_decode(parts[2])
        except ValueError:
            return None
        if not hmac.compare_digest(mac, hmac.new(self._tokens(), claims, hashlib.sha256).digest()):
            return None
        fields = claims.decode("utf-8", "replace").split("\n")
        return fields if len(fields) == 5 else None

    def token_subscription(self, token: str) -> str | None:
        """The id of the subscription a wake token (claim or callback token) was issued for, of
        any incarnation, generation or wake, or None when this server did not issue it. The guard
        lets exactly such tokens through to the routes they are for; fencing is
        :meth:`_check_token`'s."""
        fields = self._token_fields(token)
        return fields[0] if fields is not None else None

    def _token(self, sub: Subscription) -> str:
        assert sub.wake_id is not None
        kind = "cb" if sub.type == "webhook" else "cl"
        claims = "\n".join((sub.id, sub.uid, str(sub.generation), sub.wake_id, kind)).encode()
        mac = hmac.new(self._tokens(), claims, hashlib.sha256).digest()
        return f"v1.{_b64url(claims)}.{_b64url(mac)}"

    def _check_token(self, sub: Subscription, token: str, reply: WakeReply) -> None:
        """401 unless the token is one this server issued for this subscription; 409 FENCED when
        the token, or the request's generation / wake_id, is not the current wake's."""
        invalid = SubscriptionError(
            Refusal.TOKEN_INVALID, f"the bearer token was not issued for subscription {sub.id!r}"
        )
        fields = self._token_fields(token)
        if fields is None or fields[0] != sub.id:
            raise invalid
        _, uid, gen, wake_id, _kind = fields
        current = (sub.uid, str(sub.generation), sub.wake_id)
        if (uid, gen, wake_id) != current or reply.generation != sub.generation or reply.wake_id != sub.wake_id:
            if sub.wake_id is None:
                why = "the wake is over (finished, released, or its lease expired)"
            else:
                why = f"the current wake is generation {sub.generation}"
            raise _fenced(f"stale wake: {why}", sub.generation)

    # ------------------------------------------------------------------ persistence

    def _file(self, sid: str) -> Path:
        return (
            self.directory / "subs" / (hashlib.sha256(sid.encode("utf-8", "surrogatepass")).hexdigest()[:40] + ".json")
        )

    def _changed(self, sub: Subscription | str) -> None:
        """Note that a subscription's state changed and write it in the background."""
        sid = sub if isinstance(sub, str) else sub.id
        self._version[sid] = self._version.get(sid, 0) + 1
        if self.closing:
            return  # close() (or the request being answered) writes it
        task = asyncio.get_running_loop().create_task(self._persist_quietly(sid))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _persist_quietly(self, sid: str) -> None:
        try:
            await self._persist(sid)
        except (OSError, RuntimeError) as exc:
            if not self.closing:
                log.error("could not store subscription %r: %s", sid, exc)

    async def _persist(self, sid: str) -> None:
        """Wait until the subscription's current state (or its absence) is on disk."""
        version = self._version.get(sid, 0)
        async with self._locks.hold(sid):
            if self._saved.get(sid, -1) >= version:
                return
            version = self._version.get(sid, 0)
            sub = self.subs.get(sid)
            data = json.dumps(sub.to_file(), separators=(",", ":")).encode() if sub is not None else None
            loop = asyncio.get_running_loop()
            write = loop.run_in_executor(self.broker.executor, self._write_file, self._file(sid), data)
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # keep the lock until the thread is done, so writes of one file never overlap
                await asyncio.wait({write})
                raise
            self._saved[sid] = version
            if sub is None and sid not in self.subs and self._version.get(sid, 0) == version:
                # deleted, and its absence is on disk: nothing of it is left to remember (ids are
                # the clients' to choose; remembering each one ever deleted grew without bound)
                self._version.pop(sid, None)
                del self._saved[sid]

    def _write_file(self, path: Path, data: bytes | None) -> None:
        """Store a subscription's file, or remove it (``data`` None); synced, with its directory,
        under the ``always`` policy. Runs in the broker's executor."""
        fs = self.fs
        durable = self.broker.fsync == "always"
        if data is None:
            if not fs.exists(path):
                return  # never stored, or already removed
            fs.unlink(path)
            if durable:
                fs.sync_dir(path.parent)
            return
        self._make_dirs(durable=durable)
        fs.replace_file(path, data, sync=durable)

    async def _commit(self, sub: Subscription) -> None:
        """Write a request's change and wait for it; a 503 if the disk refused."""
        self._changed(sub)
        try:
            await self._persist(sub.id)
        except (OSError, RuntimeError) as exc:
            raise _unstored("the subscription state", exc) from None

    # ------------------------------------------------------------------ streams and links

    def _live(self, name: str) -> StreamState | None:
        s = self.broker.get(name)
        if s is None or s.deleted or s.meta.soft_deleted:
            return None
        return s

    def _index(self, sub: Subscription) -> None:
        for path in sub.links:
            self._by_stream.setdefault(path, set()).add(sub.id)
        if sub.config.pattern is not None:
            self._patterns[sub.id] = tuple(sub.config.pattern.split("/"))
        if sub.config.wake_stream is not None:
            self._by_wake.setdefault(sub.config.wake_stream, set()).add(sub.id)

    def _unindex(self, sub: Subscription) -> None:
        for path in sub.links:
            self._drop_index(self._by_stream, path, sub.id)
        self._patterns.pop(sub.id, None)
        if sub.config.wake_stream is not None:
            self._drop_index(self._by_wake, sub.config.wake_stream, sub.id)

    @staticmethod
    def _drop_index(index: dict[str, set[str]], key: str, sid: str) -> None:
        ids = index.get(key)
        if ids is not None:
            ids.discard(sid)
            if not ids:
                del index[key]

    def _forget_stream(self, name: str) -> None:
        """A stream deleted (the broker tells, whoever deleted it): keep nothing of it, its log
        least of all (a stream created again under its name is seen and watched anew)."""
        self._seen.pop(name, None)
        self._watched.pop(name, None)

    def _watch(self, s: StreamState) -> None:
        if self._watched.get(s.name) is not s.log:
            name = s.name
            s.log.add_listener(lambda: self._on_durable(name))
            self._watched[name] = s.log

    def _link(self, sub: Subscription, path: str, *, explicit: bool, at_tail: bool) -> Link:
        """Link ``path``: an existing stream at its tail when ``at_tail`` (else from its start)."""
        link = sub.links.get(path)
        if link is None:
            link = Link(path)
            s = self._live(path)
            if s is not None:
                link.born = s.meta.created_ms
                link.acked = s.stable() if at_tail else None
                self._watch(s)
            sub.links[path] = link
            self._by_stream.setdefault(path, set()).add(sub.id)
        if explicit:
            link.explicit = True
        else:
            link.glob = True
        return link

    def _unlink(self, sub: Subscription, path: str) -> None:
        if sub.links.pop(path, None) is not None:
            self._drop_index(self._by_stream, path, sub.id)
        sub.snapshot.pop(path, None)

    def _refresh(self, sub: Subscription, link: Link) -> StreamState | None:
        """The link's stream, after fitting the link to what happened to it: a glob link to a
        deleted stream goes, an explicit one starts over, and a stream re-created under the
        same name is read from its start."""
        s = self._live(link.path)
        if s is None:
            if not link.explicit:
                self._unlink(sub, link.path)
                self._changed(sub)
            elif link.born is not None or link.acked is not None:
                link.born, link.acked = None, None
                self._changed(sub)
            return None
        if link.born != s.meta.created_ms:
            if link.born is not None:
                link.acked = None
            link.born = s.meta.created_ms
            self._changed(sub)
        self._watch(s)
        return s

    def _start_of(self, s: StreamState) -> Position:
        start = self.broker.resolve_start(s, BEFORE_FIRST)
        return start if isinstance(start, Position) else ZERO

    def stream_infos(self, sub: Subscription) -> list[LinkState]:
        """Each linked stream with its cursor, tail (the last stable offset) and pending state."""
        out: list[LinkState] = []
        for path in sorted(sub.links):
            link = sub.links[path]
            s = self._refresh(sub, link)
            if path not in sub.links:
                continue
            if s is None:
                out.append(LinkState(path, link.link_type, link.acked, None, False))
                continue
            tail = s.stable()
            done = link.acked if link.acked is not None else self._start_of(s)
            out.append(LinkState(path, link.link_type, link.acked, tail, tail.pos > done.pos))
        return out

    def stream_changed(self, name: str) -> None:
        """A stream was created, appended to, closed or deleted (called after such a request, whose
        answer is decided: nothing here may change it). Before the subscriptions are started, the
        change waits for the start (:meth:`try_start`), which processes it."""
        if not self._started:
            self._changed_before_start.add(name)
            self.try_start()
            return
        self._process(name)

    def _on_durable(self, name: str) -> None:
        # called from inside the log's commit: defer the work to the loop
        if self.closing or not self.subs:
            return
        self._dirty.add(name)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        names, self._dirty = self._dirty, set()
        for name in names:
            self._process(name)

    def _process(self, name: str) -> None:
        if self.closing or not self.subs:
            return
        s = self._live(name)
        if s is None:
            self._forget_stream(name)
        elif self._seen.get(name) is not s.log:
            # first sight of this stream (or of a new stream under this name): the patterns that
            # match it link it from its start, so the append that created it counts as pending
            self._seen[name] = s.log
            for sid, parts in self._patterns.items():
                matching = self.subs[sid]
                if name not in matching.links and name != matching.config.wake_stream and glob_match(parts, name):
                    self._link(matching, name, explicit=False, at_tail=False)
                    self._changed(matching)
        for sid in list(self._by_stream.get(name, ())):
            linked = self.subs.get(sid)
            link = linked.links.get(name) if linked is not None else None
            if linked is not None and link is not None:
                self._refresh(linked, link)
                self._maybe_wake(linked, name)
        if s is not None:
            for sid in list(self._by_wake.get(name, ())):
                waker = self.subs.get(sid)
                if waker is not None:
                    self._watch(s)
                    if waker.wake_id is not None and not waker.announced and waker.holder is None:
                        self._spawn(self._announce(waker.id, waker.uid, waker.wake_id))

    # ------------------------------------------------------------------ wakes

    def _maybe_wake(self, sub: Subscription, trigger: str | None = None) -> bool:
        """Issue a wake when the subscription is idle and has pending work; True if it did."""
        if sub.wake_id is not None or self.closing:
            return False
        pending = [i.path for i in self.stream_infos(sub) if i.pending]
        if not pending:
            return False
        self._new_wake(sub, trigger if trigger in pending else pending[0])
        if sub.type == "webhook":
            self._spawn(self._deliver(sub.id, sub.uid, sub.wake_id))
        else:
            self._spawn(self._announce(sub.id, sub.uid, sub.wake_id))
        return True

    def _new_wake(self, sub: Subscription, trigger: str) -> None:
        sub.generation += 1
        sub.wake_id = "w_" + secrets.token_hex(12)
        sub.trigger = trigger
        sub.snapshot = {}
        sub.holder = None
        sub.lease_deadline = None
        sub.announced = False
        self._changed(sub)

    def _end_wake(self, sub: Subscription) -> None:
        sub.wake_id = None
        sub.trigger = None
        sub.snapshot = {}
        sub.holder = None
        sub.lease_deadline = None
        sub.announced = False
        sub.status = "active"
        sub.attempts = 0
        sub.next_attempt_at = None
        self._arm(sub)
        self._changed(sub)

    def _current(self, sid: str, uid: str, wake_id: str | None) -> Subscription | None:
        sub = self.subs.get(sid)
        if sub is None or sub.uid != uid or sub.wake_id != wake_id or self.closing:
            return None
        return sub

    def _arm(self, sub: Subscription) -> None:
        """(Re)set the subscription's one timer: lease expiry or the next webhook retry."""
        if sub.timer is not None:
            sub.timer.cancel()
            sub.timer = None
        deadlines = [d for d in (sub.lease_deadline, sub.next_attempt_at) if d is not None]
        if not deadlines or self.closing:
            return
        delay = max(0.0, min(deadlines) - self.clock.time())
        sub.timer = asyncio.get_running_loop().call_later(delay, self._on_timer, sub.id, sub.uid)

    def _on_timer(self, sid: str, uid: str) -> None:
        sub = self.subs.get(sid)
        if sub is None or sub.uid != uid or self.closing:
            return
        sub.timer = None
        now = self.clock.time()
        if sub.lease_deadline is not None and now >= sub.lease_deadline:
            self._expire_lease(sub)
        elif sub.next_attempt_at is not None and now >= sub.next_attempt_at and sub.wake_id is not None:
            sub.next_attempt_at = None
            self._changed(sub)
            self._spawn(self._deliver(sub.id, sub.uid, sub.wake_id))
        else:
            self._arm(sub)

    def _expire_lease(self, sub: Subscription) -> None:
        log.info(
            "subscription %r: the lease of wake %s (generation %d, holder %s) expired",
            sub.id,
            sub.wake_id,
            sub.generation,
            sub.holder or "webhook",
        )
        self._end_wake(sub)
        self._maybe_wake(sub)

    def _expire_if_due(self, sub: Subscription) -> None:
        if sub.lease_deadline is not None and self.clock.time() >= sub.lease_deadline:
            self._expire_lease(sub)

    async def _announce(self, sid: str, uid: str, wake_id: str | None) -> None:
        """Append the pull-wake event for the current wake to the wake stream."""
        sub = self._current(sid, uid, wake_id)
        if sub is None or sub.announced or sub.holder is not None or sub.announcing == wake_id:
            return
        sub.announcing = wake_id
        try:
            await self._announce_once(sub, wake_id)
        finally:
            if sub.announcing == wake_id:
                sub.announcing = None

    async def _announce_once(self, sub: Subscription, wake_id: str | None) -> None:
        sid, uid = sub.id, sub.uid
        try:
            await self._persist(sid)  # the generation is on disk before any worker can see it
        except (OSError, RuntimeError) as exc:
            log.error("subscription %r: could not store wake state: %s", sid, exc)
        if self._current(sid, uid, wake_id) is not sub or sub.announced or sub.holder is not None:
            return
        name = sub.config.wake_stream
        assert name is not None
        ws = self._live(name)
        if ws is None:
            log.warning(
                "subscription %r: wake stream %r does not exist; the wake is written once it is created", sid, name
            )
            return
        event = {
            "type": "wake",
            "subscription_id": sid,
            "stream": sub.trigger,
            "generation": sub.generation,
            "ts": int(self.clock.time() * 1000),
        }
        data = json.dumps(event, separators=(",", ":")).encode()
        if not ws.is_json:
            data += b"\n"
        outcome = await self.broker.append(name, data, content_type=ws.meta.content_type)
        if outcome.kind != "appended":
            log.warning(
                "subscription %r: could not write a wake event to %r: %s", sid, name, outcome.detail or outcome.kind
            )
            return
        if self._current(sid, uid, wake_id) is sub and not sub.announced:
            sub.announced = True
            self._changed(sub)

    async def _deliver(self, sid: str, uid: str, wake_id: str | None) -> None:
        """POST the current wake to the webhook; on failure schedule a retry with backoff."""
        sub = self._current(sid, uid, wake_id)
        if sub is None or sub.delivering == wake_id or sub.next_attempt_at is not None:
            return
        sub.delivering = wake_id
        error: str | None = None
        status, answer = 0, b""
        try:
            infos = self.stream_infos(sub)
            sub.snapshot = {i.path: i.tail for i in infos if i.tail is not None}
            payload = {
                "subscription_id": sid,
                "wake_id": wake_id,
                "generation": sub.generation,
                "streams": [i.to_json(with_tail=True) for i in infos],
                "callback_url": f"{sub.base_url}/__ds/subscriptions/{quote(sid, safe='')}/callback",
                "callback_token": self._token(sub),
            }
            body = json.dumps(payload, separators=(",", ":")).encode()
            url = sub.config.webhook_url
            assert url is not None
            timeout = sub.config.lease_ttl_ms / 1000
            await self._persist(sid)  # the generation is on disk before the receiver sees it
            headers = {
                "content-type": "application/json",
                "webhook-signature": self.sign(body),
                "user-agent": "onceflow",
            }
            status, answer = await self.poster(url, body, headers, timeout)
            if not 200 <= status < 300:
                error = f"the webhook answered HTTP {status}"
        except DeliveryError as exc:
            error = str(exc) or type(exc).__name__
        except (OSError, RuntimeError) as exc:
            error = f"could not store the wake: {exc}"
        except Exception as exc:  # noqa: BLE001 - whatever a receiver does must end in a retry, not a stuck wake
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if sub.delivering == wake_id:
                sub.delivering = None
        if self._current(sid, uid, wake_id) is not sub:
            return  # finished by a callback, deleted or fenced meanwhile
        if error is not None:
            sub.attempts += 1
            delay = min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2 ** min(sub.attempts - 1, 16))
            delay *= 1 + self.rng.uniform(-RETRY_JITTER, RETRY_JITTER)  # noqa: S311 - jitter, not security
            sub.status = "failed"
            sub.next_attempt_at = self.clock.time() + delay
            log.warning(
                "subscription %r: webhook delivery %d failed (%s); retrying in %.1fs", sid, sub.attempts, error, delay
            )
            self._arm(sub)
            self._changed(sub)
            return
        sub.status = "active"
        sub.attempts = 0
        sub.announced = True
        done = False
        with contextlib.suppress(ValueError, RecursionError):  # any answer that is not {"done": true} starts the lease
            reply = json.loads(answer) if answer.strip() else None
            done = isinstance(reply, dict) and reply.get("done") is True
        if done:
            # the handler finished synchronously: everything the wake carried is processed
            for path, tail in sub.snapshot.items():
                link = sub.links.get(path)
                if link is not None and (link.acked is None or link.acked.pos < tail.pos):
                    link.acked = tail
            self._end_wake(sub)
            self._maybe_wake(sub)
        else:
            sub.lease_deadline = self.clock.time() + sub.config.lease_ttl_ms / 1000
            self._arm(sub)
            self._changed(sub)

    # ------------------------------------------------------------------ API

    def get(self, sid: str) -> Subscription:
        sub = self.subs.get(sid)
        if sub is None:
            raise _not_found(sid)
        self._expire_if_due(sub)
        return sub

    async def create(self, sid: str, config: Config, base_url: str) -> tuple[Subscription, bool]:
        """Create the subscription, or confirm an identical one (False). 409 when it differs."""
        validate_id(sid)
        existing = self.subs.get(sid)
        digest = config.digest()
        if existing is not None:
            if existing.config_hash != digest:
                raise SubscriptionError(
                    Refusal.SUBSCRIPTION_ALREADY_EXISTS,
                    f"subscription {sid!r} exists with a different configuration; DELETE it first or use another id",
                )
            return existing, False
        limit = self.broker.coordinator.limits.subscriptions
        if len(self.subs) >= limit:
            raise SubscriptionError(
                Refusal.LIMIT,
                f"this server holds its limit of {limit} subscriptions (onceflow serve --max-subscriptions); "
                "delete subscriptions no longer used or raise the limit",
            )
        if config.type == "webhook":
            try:
                self.signing_key()
            except (OSError, ValueError) as exc:
                raise SubscriptionError(
                    Refusal.SUBSCRIPTION_UNAVAILABLE, f"the webhook signing key is unavailable: {exc}"
                ) from None
        sub = Subscription(sid, secrets.token_hex(8), config, digest, _iso(self.clock.time()), base_url)
        for path in config.streams:
            self._link(sub, path, explicit=True, at_tail=True)
        if config.pattern is not None:
            parts = tuple(config.pattern.split("/"))
            for s in self.broker.list():
                if s.name != config.wake_stream and s.name.split("/", 1)[0] != "__ds" and glob_match(parts, s.name):
                    self._link(sub, s.name, explicit=False, at_tail=True)
        self.subs[sid] = sub
        self._index(sub)
        try:
            await self._commit(sub)
        except SubscriptionError:
            if self.subs.get(sid) is sub:
                self._unindex(sub)
                del self.subs[sid]
            raise
        self._resume(sub)
        return sub, True

    async def delete(self, sid: str) -> None:
        """Delete (idempotent). Tokens of its wakes are refused from now on."""
        validate_id(sid)
        sub = self.subs.pop(sid, None)
        if sub is None:
            return
        if sub.timer is not None:
            sub.timer.cancel()
            sub.timer = None
        self._unindex(sub)
        self._version[sid] = self._version.get(sid, 0) + 1
        try:
            await self._persist(sid)
        except (OSError, RuntimeError) as exc:
            raise _unstored("the deletion", exc) from None

    async def add_streams(self, sid: str, body: object) -> None:
        sub = self.get(sid)
        if not isinstance(body, dict) or not isinstance(body.get("streams"), list) or not body["streams"]:
            raise _invalid('the body must be {"streams": ["<stream path>", ...]} with at least one path')
        if len(body["streams"]) > MAX_STREAMS:
            raise _invalid(f'"streams" may list at most {MAX_STREAMS} streams')
        paths = [normalize_path(p, f"streams[{i}]") for i, p in enumerate(body["streams"])]
        for path in paths:
            if path == sub.config.wake_stream:
                raise _invalid(f"{path!r} is this subscription's wake stream; every wake would wake it again")
        for path in paths:
            self._link(sub, path, explicit=True, at_tail=True)
        await self._commit(sub)
        self._maybe_wake(sub)

    async def remove_stream(self, sid: str, raw_path: str) -> None:
        sub = self.get(sid)
        path = normalize_path(raw_path, "the stream path")
        link = sub.links.get(path)
        if link is None or not link.explicit:
            return
        link.explicit = False
        if not link.glob:
            self._unlink(sub, path)
        await self._commit(sub)

    async def claim(self, sid: str, body: object) -> dict[str, object]:
        sub = self.get(sid)
        if not isinstance(body, dict) or not isinstance(body.get("worker"), str) or not body["worker"]:
            raise _invalid('the body needs "worker": a non-empty name for the claiming worker')
        worker: str = body["worker"]
        if len(worker) > MAX_WORKER:
            raise _invalid(f'"worker" is longer than {MAX_WORKER} characters')
        self._require(sub, "pull-wake", "claim")
        if sub.holder is not None:
            raise SubscriptionError(
                Refusal.ALREADY_CLAIMED,
                f"worker {sub.holder!r} holds the current wake",
                current_holder=sub.holder,
                generation=sub.generation,
            )
        infos = self.stream_infos(sub)
        pending = [i.path for i in infos if i.pending]
        if not pending:
            if sub.wake_id is not None:
                self._end_wake(sub)  # its streams went away
            raise SubscriptionError(Refusal.NO_PENDING_WORK, f"subscription {sid!r} has no pending work")
        if sub.wake_id is None:
            self._new_wake(sub, pending[0])
            sub.announced = True  # claimed at once: no wake event needed
        sub.holder = worker
        sub.lease_deadline = self.clock.time() + sub.config.lease_ttl_ms / 1000
        self._arm(sub)
        await self._commit(sub)
        return {
            "wake_id": sub.wake_id,
            "generation": sub.generation,
            "token": self._token(sub),
            "streams": [i.to_json(with_tail=True) for i in infos],
            "lease_ttl_ms": sub.config.lease_ttl_ms,
        }

    async def callback(self, sid: str, token: str | None, body: object) -> dict[str, object]:
        """A webhook receiver's asynchronous answer: acks, heartbeat and done."""
        return await self._answer(sid, token, body, "webhook", "callback")

    async def ack(self, sid: str, token: str | None, body: object) -> dict[str, object]:
        """A pull-wake worker's acks; without ``done`` a heartbeat that extends the lease."""
        return await self._answer(sid, token, body, "pull-wake", "ack")

    async def release(self, sid: str, token: str | None, body: object) -> None:
        """Hand the wake back without acking; pending work is woken again."""
        sub = self.get(sid)
        if token is None:
            raise SubscriptionError(Refusal.TOKEN_INVALID, "release needs Authorization: Bearer <claim token>")
        reply = parse_wake_reply(body, acks_allowed=False)
        self._require(sub, "pull-wake", "release")
        self._check_token(sub, token, reply)
        self._end_wake(sub)
        self._maybe_wake(sub)
        await self._commit(sub)

    async def _answer(
        self, sid: str, token: str | None, body: object, kind: SubscriptionType, action: str
    ) -> dict[str, object]:
        sub = self.get(sid)
        if token is None:
            what = "callback token" if kind == "webhook" else "claim token"
            raise SubscriptionError(Refusal.TOKEN_INVALID, f"{action} needs Authorization: Bearer <{what}>")
        reply = parse_wake_reply(body)
        self._require(sub, kind, action)
        self._check_token(sub, token, reply)
        self._apply_acks(sub, reply.acks)
        next_wake = False
        if reply.done:
            self._end_wake(sub)
            next_wake = self._maybe_wake(sub)
        else:
            sub.announced = True
            sub.status, sub.attempts, sub.next_attempt_at = "active", 0, None
            sub.lease_deadline = self.clock.time() + sub.config.lease_ttl_ms / 1000
            self._arm(sub)
        await self._commit(sub)
        return {"ok": True, "next_wake": next_wake}

    @staticmethod
    def _require(sub: Subscription, kind: SubscriptionType, action: str) -> None:
        if sub.type != kind:
            hint = (
                "a webhook answers through /callback"
                if sub.type == "webhook"
                else "pull-wake workers use /claim, /ack and /release"
            )
            raise _invalid(f"subscription {sub.id!r} is a {sub.type} subscription: {action} is not for it ({hint})")

    def _apply_acks(self, sub: Subscription, acks: Sequence[tuple[str, Position]]) -> None:
        """Validate every ack, then move the cursors (all or nothing)."""
        moves: dict[str, Position] = {}
        for path, at in acks:
            link = sub.links.get(path)
            s = self._refresh(sub, link) if link is not None else None
            if link is None or path not in sub.links:
                raise SubscriptionError(
                    Refusal.INVALID_OFFSET, f"stream {path!r} is not linked to subscription {sub.id!r}"
                )
            if s is None:
                raise SubscriptionError(Refusal.INVALID_OFFSET, f"stream {path!r} does not exist (any more)")
            done = link.acked if link.acked is not None else self._start_of(s)
            if at.pos < done.pos:
                raise SubscriptionError(
                    Refusal.INVALID_OFFSET, f"ack {at.token()} for {path!r} is behind its acked offset {done.token()}"
                )
            if at.pos > s.stable().pos:
                raise SubscriptionError(
                    Refusal.INVALID_OFFSET, f"ack {at.token()} for {path!r} is beyond its tail {s.stable().token()}"
                )
            try:
                s.check_position(at)
            except InvalidPosition as exc:
                raise SubscriptionError(Refusal.INVALID_OFFSET, f"ack for {path!r}: {exc}") from None
            prev = moves.get(path)
            moves[path] = at if prev is None or prev.pos < at.pos else prev
        for path, at in moves.items():
            sub.links[path].acked = at

    def describe(self, sub: Subscription, jwks_url: str) -> dict[str, object]:
        """The subscription as GET shows it."""
        webhook: dict[str, object] | None = None
        if sub.config.webhook_url is not None:
            webhook = {
                "url": sub.config.webhook_url,
                "signing": {"alg": "ed25519", "kid": self.kid, "jwks_url": jwks_url},
            }
        return {
            "id": sub.id,
            "subscription_id": sub.id,
            "type": sub.type,
            "pattern": sub.config.pattern,
            "streams": [i.to_json(with_tail=False) for i in self.stream_infos(sub)],
            "webhook": webhook,
            "wake_stream": sub.config.wake_stream,
            "lease_ttl_ms": sub.config.lease_ttl_ms,
            "created_at": sub.created_at,
            "status": sub.status,
            "description": sub.config.description,
        }
