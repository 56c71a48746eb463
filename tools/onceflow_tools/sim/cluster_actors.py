"""The clients of the simulated cluster that check what a single server cannot get wrong: answers
that say more than the server knows, and reads answered by a server that no longer leads.

- :func:`plain_appender`: plain (not idempotent) appends of one value each, recorded with what the
  answer said: stored (2xx), surely not stored (a refusal: 4xx, 503 ``unavailable`` or
  ``not_leader``, a connection refused), or unknown (a timeout, a broken connection, 502,
  ``outcome_unknown``). The history checker holds the server to it: a value answered "not
  stored" must never be read (``refused-write-stored``), one answered "stored" must be.
- :func:`linear_reader`: reads a stream from its start to its end and checks that every append
  acknowledged before the read began is in it (``stale-read``): the reads of a cluster are
  linearizable, whichever server answers and whatever its clocks do.
- :func:`deleter`: creates streams, appends to them and deletes them. A delete answered as not done
  leaves the stream, and appends acknowledged after it, in place; an acknowledged delete is final.
  Checked at the end (:meth:`ClusterChecks.check`): a stream acknowledged and not deleted is there
  with every acknowledged value; a stream whose delete was acknowledged is not.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from ..chaos.history import Anomaly
from .actors import JSON, Env, ensure_stream, nap, read_records, surl

__all__ = ["CLUSTER_ACTORS", "ClusterChecks", "ClusterEnv", "outcome_of"]

UNKNOWN_CODES = frozenset({"outcome_unknown", "leader_unreachable", "lease_changed"})
REFUSED_CODES = frozenset({"unavailable", "not_leader"})


@dataclass
class ClusterChecks:
    """What the cluster's clients learned, checked when the run ends."""

    acked: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # stream: (when, value), in order
    kept: dict[str, list[str]] = field(default_factory=dict)  # streams that must exist: their acked values
    deleted: set[str] = field(default_factory=set)  # streams whose delete was acknowledged

    def check(self, final: dict[str, list[Any]]) -> list[Anomaly]:
        """``final``: every stream's values as read at the end."""
        out: list[Anomaly] = []
        for stream, values in sorted(self.kept.items()):
            if stream not in final:
                out.append(Anomaly("lost-write", stream, f"{stream} was never deleted, yet it is gone"))
                continue
            missing = [v for v in values if v not in final[stream]]
            if missing:
                out.append(Anomaly("lost-write", stream, f"{stream} lost acknowledged values {missing[:5]}"))
        for stream in sorted(self.deleted & set(final)):
            out.append(Anomaly("lost-write", stream, f"{stream} is there although its delete was acknowledged"))
        return out


class ClusterEnv(Env, Protocol):
    checks: ClusterChecks

    def now(self) -> float: ...


def _code(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


def outcome_of(r: httpx.Response | BaseException) -> str:
    """``ok``, ``fail`` (surely not done) or ``unknown``, as a careful client reads an answer."""
    if isinstance(r, httpx.ConnectError):  # refused, or every server a follower: nothing was sent
        return "fail"
    if isinstance(r, BaseException):
        return "unknown"
    if 200 <= r.status_code < 300:
        return "ok"
    if 400 <= r.status_code < 500:
        return "fail"
    if r.status_code == 503 and _code(r) in REFUSED_CODES:
        return "fail"
    return "unknown"


async def _send(c: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> httpx.Response | BaseException:
    try:
        return await c.request(method, url, **kwargs)
    except httpx.TransportError as exc:
        return exc


async def _append(env: ClusterEnv, c: httpx.AsyncClient, name: str, ident: int, stream: str, value: str) -> str:
    env.record(name, "append", id=ident, stream=stream, values=[value])
    r = await _send(c, "POST", surl(stream), content=json.dumps([value]).encode(), headers=JSON)
    outcome = outcome_of(r)
    env.trace(
        name, f"append {value} to {stream}: {outcome} ({r.status_code if isinstance(r, httpx.Response) else r!r})"
    )
    if outcome != "unknown":
        env.record(name, "ack", id=ident, outcome=outcome)
    if outcome == "ok":
        env.checks.acked.setdefault(stream, []).append((env.now(), value))
    return outcome


async def plain_appender(env: ClusterEnv, name: str, stream: str) -> None:
    c = env.client(name)
    await ensure_stream(c, env, stream)
    n = 0
    while not env.stopping():
        n += 1
        await _append(env, c, name, n, stream, f"{name}:{n}")
        await nap(env, 0.01, 0.15)


async def linear_reader(env: ClusterEnv, name: str, streams: list[str]) -> None:
    c = env.client(name)
    while not env.stopping():
        await nap(env, 0.02, 0.3)
        stream = env.rng.choice(streams)
        began = env.now()
        before = [v for t, v in env.checks.acked.get(stream, []) if t < began]
        at, whole = "-1", False
        values: set[Any] = set()
        for _ in range(50):
            got = await read_records(c, stream, at)
            if got is None:
                break
            nxt, records = got
            values.update(v for _, v in records)
            if nxt == at:
                whole = True
                break
            at = nxt
        if not whole:
            continue
        missing = [v for v in before if v not in values]
        if missing:
            env.anomaly(
                "stale-read",
                stream,
                f"a read of {stream} that began at {began - 1000:.4f} missed {len(missing)} values acknowledged "
                f"before it began, e.g. {missing[:3]}",
            )


async def deleter(env: ClusterEnv, name: str) -> None:
    c = env.client(name)
    k, n = 0, 0
    while not env.stopping():
        k += 1
        stream = f"del/{name}/{k}"
        await ensure_stream(c, env, stream)
        env.checks.kept[stream] = []
        for _ in range(env.rng.randint(1, 3)):
            n += 1
            if await _append(env, c, name, n, stream, f"{name}:{n}") == "ok":
                env.checks.kept[stream].append(f"{name}:{n}")
        await nap(env)
        r = await _send(c, "DELETE", surl(stream))
        outcome = outcome_of(r)
        env.trace(name, f"delete {stream}: {outcome} ({r.status_code if isinstance(r, httpx.Response) else r!r})")
        if outcome == "ok":
            del env.checks.kept[stream]
            env.checks.deleted.add(stream)
            continue
        if outcome == "unknown":
            del env.checks.kept[stream]  # deleted or not: nothing to hold it to
            continue
        # refused: the stream stays, and so does what is appended to it from now on
        for _ in range(env.rng.randint(1, 3)):
            n += 1
            if await _append(env, c, name, n, stream, f"{name}:{n}") == "ok":
                env.checks.kept[stream].append(f"{name}:{n}")
            await nap(env, 0.01, 0.1)


CLUSTER_ACTORS: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "plain": plain_appender,
    "linear": linear_reader,
    "deleter": deleter,
}
