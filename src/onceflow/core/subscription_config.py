"""What a subscription is made of (PROTOCOL.md sections 6-7): its id, its stream patterns, where its
webhooks may go, its configuration as a request gives it, and the body of a reply to a wake; each
checked, with :class:`SubscriptionError` for what is wrong. The subscriptions themselves (state,
wakes, leases, deliveries) are core/subscriptions.py's."""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from ..storage.position import Position, parse_token
from .broker import validate_name
from .refusal import Refusal, Refused

__all__ = [
    "BEFORE_FIRST",
    "DEFAULT_LEASE_TTL_MS",
    "MAX_LEASE_TTL_MS",
    "MIN_LEASE_TTL_MS",
    "Config",
    "IPAddress",
    "SubscriptionError",
    "SubscriptionType",
    "WakeReply",
    "WebhookTargets",
    "address_kind",
    "allowed_target",
    "glob_match",
    "glob_prefix",
    "is_public_address",
    "normalize_path",
    "parse_config",
    "parse_pattern",
    "parse_wake_reply",
    "unwrap_ipv4",
    "validate_id",
    "validate_webhook_url",
]

DEFAULT_LEASE_TTL_MS = 30_000
MIN_LEASE_TTL_MS = 1_000
MAX_LEASE_TTL_MS = 600_000
MAX_ID_BYTES = 256
MAX_STREAMS = 10_000
MAX_DESCRIPTION = 4096
MAX_URL = 2048
MAX_WORKER = 256
BEFORE_FIRST = "-1"

SubscriptionType = Literal["webhook", "pull-wake"]


class SubscriptionError(Refused):
    """A refused subscription request: ``refusal`` says why (``code`` is its protocol error code),
    ``extra`` what the error body reports besides. ``onceflow.server.answers`` gives its status."""


def _invalid(message: str) -> SubscriptionError:
    return SubscriptionError(Refusal.INVALID_REQUEST, message)


# ---------------------------------------------------------------------- names, globs, URLs


def validate_id(sid: str) -> None:
    """Raise unless ``sid`` can name a subscription (one URL path segment, decoded)."""
    if not sid:
        raise _invalid("the subscription id is empty")
    if len(sid.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise _invalid(f"the subscription id is longer than {MAX_ID_BYTES} bytes")
    if "/" in sid or any(ord(c) < 0x20 or ord(c) == 0x7F for c in sid):
        raise _invalid("the subscription id must not contain '/' or control characters")


def normalize_path(value: object, what: str) -> str:
    """A stream-root-relative stream path from a request (outer slashes dropped), or a 400."""
    if not isinstance(value, str):
        raise _invalid(f"{what} must be a string stream path such as 'events/abc'")
    path = value.strip("/")
    problem = validate_name(path)
    if problem:
        raise _invalid(f"{what} {value!r} is not a valid stream path: {problem}")
    if path.split("/", 1)[0] == "__ds":
        raise _invalid(f"{what} {value!r} is under the reserved __ds prefix")
    return path


def parse_pattern(value: object) -> str:
    """The normalized glob; ``*`` and ``**`` must be whole segments."""
    if not isinstance(value, str) or not value.strip("/"):
        raise _invalid("pattern must be a non-empty glob over stream paths such as 'events/*'")
    pattern = value.strip("/")
    if len(pattern.encode()) > 1024:
        raise _invalid("pattern is longer than 1024 bytes")
    for seg in pattern.split("/"):
        if seg in ("*", "**"):
            continue
        if "*" in seg:
            raise _invalid(f"pattern {value!r}: '*' and '**' must be whole path segments (got {seg!r})")
        if seg in ("", ".", "..") or "\\" in seg or any(ord(c) < 0x20 or ord(c) == 0x7F for c in seg):
            raise _invalid(f"pattern {value!r} has an empty, '.', '..' or malformed segment")
    if pattern.split("/", 1)[0] == "__ds":
        raise _invalid("pattern must not cover the reserved __ds prefix")
    return pattern


def glob_match(pattern: Sequence[str], path: str) -> bool:
    """Whether ``path`` matches the pattern segments: ``*`` is one segment, ``**`` zero or more."""
    n = len(pattern)

    def closure(states: set[int]) -> set[int]:
        out = set(states)
        todo = list(states)
        while todo:
            i = todo.pop()
            if i < n and pattern[i] == "**" and i + 1 not in out:
                out.add(i + 1)
                todo.append(i + 1)
        return out

    states = closure({0})
    for seg in path.split("/"):
        nxt: set[int] = set()
        for i in states:
            if i < n:
                p = pattern[i]
                if p == "**":
                    nxt.add(i)
                elif p == "*" or p == seg:
                    nxt.add(i + 1)
        if not nxt:
            return False
        states = closure(nxt)
    return n in states


def glob_prefix(pattern: str) -> str:
    """A string every stream name ``pattern`` (normalized, see :func:`parse_pattern`) matches starts
    with: the pattern itself when it has no wildcard, else its literal segments before the first
    one, with a trailing ``/`` unless the rest can match zero segments (``a/**`` matches ``a``).
    The guard checks a pattern against grants through this prefix."""
    segments = pattern.split("/")
    for i, seg in enumerate(segments):
        if seg in ("*", "**"):
            literal = "/".join(segments[:i])
            if all(s == "**" for s in segments[i:]) or not literal:
                return literal
            return literal + "/"
    return pattern


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
WebhookTargets = Literal["public", "loopback", "private"]
"""Where webhooks may go (``onceflow serve --webhook-targets``): public addresses only (the
default); also loopback (the protocol's development exception, and what the conformance suite
needs); also loopback and private networks. Link-local (cloud metadata at 169.254.169.254),
unspecified, multicast and reserved addresses never."""
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix: the IPv4 address in the last 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215 local-use prefix: never public
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d (:: and ::1 are not IPv4)
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_PRIVATE = (
    ipaddress.ip_network("10.0.0.0/8"),
    ipaddress.ip_network("172.16.0.0/12"),
    ipaddress.ip_network("192.168.0.0/16"),
    ipaddress.ip_network("100.64.0.0/10"),
    ipaddress.ip_network("fc00::/7"),
)
_LOOPBACK_NAMES = ("localhost",)
_LOOPBACK_SUFFIXES = (".localhost",)
_LOCAL_SUFFIXES = (".local", ".internal", ".lan", ".home.arpa", ".intranet", ".corp")


def unwrap_ipv4(addr: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, IPv4-compatible, 6to4 or NAT64
    well-known prefix), else ``addr``: a target is judged by where its packets end up."""
    if isinstance(addr, ipaddress.IPv4Address):
        return addr
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr in _NAT64 or (addr in _IPV4_COMPATIBLE and int(addr) > 1):
        return ipaddress.IPv4Address(int(addr) & 0xFFFF_FFFF)
    return addr


def _in(addr: IPAddress, nets: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    target = unwrap_ipv4(addr)
    return any(target.version == net.version and target in net for net in nets)


def is_public_address(addr: IPAddress) -> bool:
    """Globally reachable unicast, judged by the embedded IPv4 address where there is one."""
    target = unwrap_ipv4(addr)
    if isinstance(target, ipaddress.IPv6Address) and target in _NAT64_LOCAL:
        return False
    return target.is_global and not target.is_multicast


def address_kind(addr: IPAddress) -> Literal["public", "loopback", "private", "never"]:
    """Which level of :data:`WebhookTargets` first allows ``addr`` ("never": none does)."""
    if is_public_address(addr):
        return "public"
    if _in(addr, _LOOPBACK):
        return "loopback"
    if _in(addr, _PRIVATE):
        return "private"
    return "never"


_ORDER: dict[str, int] = {"public": 0, "loopback": 1, "private": 2, "never": 3}


def allowed_target(addr: IPAddress, targets: WebhookTargets) -> bool:
    """Whether a webhook may be sent to ``addr`` under the server's ``targets``."""
    return _ORDER[address_kind(addr)] <= _ORDER[targets]


def validate_webhook_url(url: object, *, targets: WebhookTargets = "public") -> str:
    """The URL, or a 400 WEBHOOK_URL_REJECTED.

    ``public`` (the default): ``https://`` to a public IP address or to a name that does not look
    local (each delivery checks what it resolves to). ``loopback``: also ``http(s)://`` to
    ``localhost`` and loopback addresses. ``private``: also to private addresses and local names
    (single labels, ``.local``, ``.internal``...). Link-local, unspecified, multicast and reserved
    addresses are refused at every level, in any IPv6 wrapping."""
    if not isinstance(url, str) or not url:
        raise _invalid('webhook subscriptions need "webhook": {"url": "https://..."}')

    def reject(why: str) -> SubscriptionError:
        return SubscriptionError(Refusal.WEBHOOK_URL_REJECTED, f"webhook.url {url!r} is rejected: {why}")

    if len(url) > MAX_URL:
        raise reject(f"it is longer than {MAX_URL} characters")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise reject("it contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        _ = parts.port
    except ValueError as exc:
        raise reject(f"it is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise reject("it must use https://")
    if not host:
        raise reject("it has no host")
    if parts.username is not None or parts.password is not None:
        raise reject("credentials in the URL would be shown to anyone who can read the subscription")
    if parts.fragment:
        raise reject("it has a #fragment")
    kind: Literal["public", "loopback", "private", "never"]
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        name = host.lower().rstrip(".")
        if name in _LOOPBACK_NAMES or name.endswith(_LOOPBACK_SUFFIXES):
            kind = "loopback"
        elif name.endswith(_LOCAL_SUFFIXES) or "." not in name:
            kind = "private"
        else:
            kind = "public"
    else:
        kind = address_kind(addr)
    if kind == "never":
        raise reject("link-local, unspecified, multicast and reserved addresses are never allowed")
    if _ORDER[kind] > _ORDER[targets]:
        raise reject(
            f"it names a {kind} target; this server sends webhooks to {targets} targets only "
            "(its operator chooses with --webhook-targets)"
        )
    if kind == "public" and parts.scheme != "https":
        raise reject("plain http:// is only allowed to loopback and private targets; use https://")
    return url


# ---------------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True)
class Config:
    """What a PUT configures; two PUTs with equal configs are the same subscription."""

    type: SubscriptionType
    pattern: str | None
    streams: tuple[str, ...]  # sorted, unique
    webhook_url: str | None
    wake_stream: str | None
    lease_ttl_ms: int
    description: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "pattern": self.pattern,
            "streams": list(self.streams),
            "webhook": {"url": self.webhook_url} if self.webhook_url is not None else None,
            "wake_stream": self.wake_stream,
            "lease_ttl_ms": self.lease_ttl_ms,
            "description": self.description,
        }

    def digest(self) -> str:
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @staticmethod
    def from_json(raw: dict[str, Any]) -> Config:
        webhook = raw.get("webhook")
        return Config(
            type=raw["type"],
            pattern=raw.get("pattern"),
            streams=tuple(raw.get("streams") or ()),
            webhook_url=webhook["url"] if webhook else None,
            wake_stream=raw.get("wake_stream"),
            lease_ttl_ms=int(raw["lease_ttl_ms"]),
            description=raw.get("description"),
        )


def parse_config(body: object, *, webhook_targets: WebhookTargets = "public") -> Config:
    """Validate a PUT body into a :class:`Config`; every problem is a 400 naming the field.
    ``webhook_targets``: see :func:`validate_webhook_url`."""
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object")
    kind = body.get("type")
    if kind not in ("webhook", "pull-wake"):
        raise _invalid(f'"type" must be "webhook" or "pull-wake", got {kind!r}')
    pattern = parse_pattern(body["pattern"]) if body.get("pattern") is not None else None
    raw_streams = body.get("streams")
    streams: list[str] = []
    if raw_streams is not None:
        if not isinstance(raw_streams, list):
            raise _invalid('"streams" must be an array of stream paths')
        if len(raw_streams) > MAX_STREAMS:
            raise _invalid(f'"streams" may list at most {MAX_STREAMS} streams')
        streams = [normalize_path(s, f"streams[{i}]") for i, s in enumerate(raw_streams)]
    if pattern is None and not streams:
        raise _invalid('a subscription needs "pattern" or a non-empty "streams" (or both)')
    webhook_url: str | None = None
    wake_stream: str | None = None
    if kind == "webhook":
        hook = body.get("webhook")
        if not isinstance(hook, dict):
            raise _invalid('webhook subscriptions need "webhook": {"url": "https://..."}')
        webhook_url = validate_webhook_url(hook.get("url"), targets=webhook_targets)
        if body.get("wake_stream") is not None:
            raise _invalid('"wake_stream" is for pull-wake subscriptions; a webhook subscription has none')
    else:
        if body.get("wake_stream") is None:
            raise _invalid('pull-wake subscriptions need "wake_stream": the stream their wake events go to')
        wake_stream = normalize_path(body["wake_stream"], "wake_stream")
        if body.get("webhook") is not None:
            raise _invalid('"webhook" is for webhook subscriptions; a pull-wake subscription has none')
        if wake_stream in streams:
            raise _invalid(
                f"the wake stream {wake_stream!r} cannot also be a subscribed stream: every wake would wake it again"
            )
    ttl = body.get("lease_ttl_ms", DEFAULT_LEASE_TTL_MS)
    if isinstance(ttl, float) and ttl.is_integer():
        ttl = int(ttl)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not MIN_LEASE_TTL_MS <= ttl <= MAX_LEASE_TTL_MS:
        raise _invalid(f'"lease_ttl_ms" must be an integer from {MIN_LEASE_TTL_MS} to {MAX_LEASE_TTL_MS}, got {ttl!r}')
    description = body.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION):
        raise _invalid(f'"description" must be a string of at most {MAX_DESCRIPTION} characters')
    return Config(kind, pattern, tuple(sorted(set(streams))), webhook_url, wake_stream, ttl, description)


@dataclass(frozen=True, slots=True)
class WakeReply:
    """The body of a callback, ack or release."""

    wake_id: str
    generation: int
    acks: tuple[tuple[str, Position], ...]
    done: bool


def parse_wake_reply(body: object, *, acks_allowed: bool = True) -> WakeReply:
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object")
    wake_id = body.get("wake_id")
    if not isinstance(wake_id, str) or not wake_id:
        raise _invalid('the body needs "wake_id": the wake being answered')
    generation = body.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise _invalid('the body needs "generation": the non-negative integer generation of the wake')
    done = body.get("done", False)
    if not isinstance(done, bool):
        raise _invalid('"done" must be true or false')
    raw_acks = body.get("acks")
    acks: list[tuple[str, Position]] = []
    if raw_acks is not None:
        if not acks_allowed:
            if raw_acks:
                raise _invalid(
                    "release takes no acks: ack (with done) to move cursors, or release to hand the wake back"
                )
        elif not isinstance(raw_acks, list):
            raise _invalid('"acks" must be an array of {"stream": "<path>", "offset": "<offset>"}')
        else:
            for i, ack in enumerate(raw_acks):
                if not isinstance(ack, dict):
                    raise _invalid(f'acks[{i}] must be an object {{"stream": "<path>", "offset": "<offset>"}}')
                stream = normalize_path(ack.get("stream", ack.get("path")), f"acks[{i}].stream")
                offset = ack.get("offset")
                at = parse_token(offset) if isinstance(offset, str) else None
                if at is None:
                    raise _invalid(
                        f"acks[{i}].offset must be an offset this server issued (a tail_offset), got {offset!r}"
                    )
                acks.append((stream, at))
    return WakeReply(wake_id, generation, tuple(acks), done)
