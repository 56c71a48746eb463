"""Redis sinks (redis-py): at-least-once appends, idempotent ``SET … NX``, and the atomic Lua sink.

Values are written as bytes: ``value(message)`` (default: the message's compact JSON, or its bytes
for a byte stream). Output goes to a list (``RPUSH``, the order of the input per stream) or, with
``field=``, to a hash (``HSET key field value``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

import redis
from redis.crc import key_slot

from ..client import Message
from ._api import Checkpoint, CheckpointAwareSink, IdempotentSink, KeyFunction, SinkError, SinkFencedError, key_function

__all__ = [
    "RedisAtomicSink",
    "RedisIdempotentSink",
    "RedisListSink",
    "ValueFunction",
    "json_value",
    "redis_client",
]

log = logging.getLogger("onceflow.sinks")

ValueFunction = Callable[[Message], bytes | str]
_CHUNK = 1000  # values per RPUSH/HSET call inside a script (Lua's unpack() has a stack limit)

# The write part shared by the consumer sink and the Spark adapter. KEYS[1] is the output key;
# ARGV[first..] are values (list) or field/value pairs (hash). A type check comes first, so no
# command can fail half-way (Redis does not roll back a script that errors after a write).
_WRITE_LUA = """
local function check_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    return redis.error_reply('WRONGTYPE onceflow: ' .. key .. ' is a ' .. t .. ', not a ' .. want)
  end
  return nil
end
local function write_values(mode, first)
  local n = #ARGV
  local cmd = 'RPUSH'
  if mode == 'hash' then cmd = 'HSET' end
  for i = first, n, CHUNK do
    redis.call(cmd, KEYS[1], unpack(ARGV, i, math.min(i + CHUNK - 1, n)))
  end
end
""".replace("CHUNK", str(_CHUNK))

# KEYS: output, checkpoint hash. ARGV: checkpoint id, expected previous id, commit token, offsets
# json, start offsets json, mode, values... Returns 1 (applied) or 0 (this very commit was applied
# before: a retry after a lost answer). A checkpoint hash holding another id than the previous one
# this runner knows means another runner committed: FENCED.
ATOMIC_LUA = (
    "#!lua\n"
    + _WRITE_LUA
    + """
local err = check_type(KEYS[1], ARGV[6] == 'hash' and 'hash' or 'list') or check_type(KEYS[2], 'hash')
if err then return err end
local cur = tonumber(redis.call('HGET', KEYS[2], 'checkpoint') or '0')
if cur == tonumber(ARGV[1]) and redis.call('HGET', KEYS[2], 'token') == ARGV[3] then return 0 end
if cur ~= tonumber(ARGV[2]) then
  return redis.error_reply('FENCED onceflow: checkpoint ' .. cur .. ' was committed by another runner')
end
write_values(ARGV[6], 7)
redis.call('HSET', KEYS[2], 'checkpoint', ARGV[1], 'token', ARGV[3], 'offsets', ARGV[4], 'start_offsets', ARGV[5])
return 1
"""
)

# KEYS: output, frontier hash. ARGV: batch id, query id, mode, values... Returns 1 (applied) or 0
# (a batch id at or below the frontier: a replay). Used by onceflow.spark.foreach_batch.redis_sink.
BATCH_LUA = (
    "#!lua\n"
    + _WRITE_LUA
    + """
local err = check_type(KEYS[1], ARGV[3] == 'hash' and 'hash' or 'list') or check_type(KEYS[2], 'hash')
if err then return err end
local cur = redis.call('HGET', KEYS[2], 'batch_id')
local query = redis.call('HGET', KEYS[2], 'query_id')
if query and ARGV[2] ~= '' and query ~= ARGV[2] then
  return redis.error_reply('QUERY onceflow: the frontier belongs to query ' .. query)
end
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
write_values(ARGV[3], 4)
redis.call('HSET', KEYS[2], 'batch_id', ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[2], 'query_id', ARGV[2]) end
return 1
"""
)


# KEYS: the keys; ARGV[1]: ttl seconds or '', ARGV[2..]: the values. SET NX each; returns how many were new.
SETNX_LUA = """#!lua
local n = 0
local ttl = ARGV[1]
for i = 1, #KEYS do
  local ok
  if ttl == '' then ok = redis.call('SET', KEYS[i], ARGV[i + 1], 'NX')
  else ok = redis.call('SET', KEYS[i], ARGV[i + 1], 'NX', 'EX', ttl) end
  if ok then n = n + 1 end
end
return n
"""


def json_value(msg: Message) -> bytes:
    """The default value: a byte stream's bytes, else the message's compact JSON."""
    v = msg.value
    if isinstance(v, bytes):
        return v
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode()


def redis_client(client: redis.Redis | str) -> redis.Redis:
    """A client: the one given, or one for a ``redis://`` URL."""
    if isinstance(client, str):
        return redis.Redis.from_url(client)
    if not isinstance(client, redis.Redis):
        raise TypeError(f"client must be a redis.Redis or a redis:// URL, not {type(client).__name__}")
    return client


def same_slot(*keys: str) -> None:
    """Keys one script touches must live in one Redis Cluster hash slot."""
    slots = {key_slot(k.encode()) for k in keys}
    if len(slots) > 1:
        raise ValueError(
            f"the keys {list(keys)} are in different Redis Cluster hash slots; give them one hash tag, "
            "e.g. 'out:{job}' and 'checkpoint:{job}'"
        )


def _values(messages: Sequence[Message], value: ValueFunction, field: KeyFunction | None) -> list[bytes | str]:
    if field is None:
        return [value(m) for m in messages]
    out: list[bytes | str] = []
    for m in messages:
        out.append(field(m))
        out.append(value(m))
    return out


class RedisListSink(CheckpointAwareSink):
    """At-least-once: each checkpoint's values are pushed (``RPUSH`` or ``HSET``) at *prepare*, with
    no offsets beside them, so input replayed after a crash is pushed again. The baseline for
    ``onceflow bench sinks``."""

    def __init__(
        self,
        client: redis.Redis | str,
        key: str,
        *,
        value: ValueFunction = json_value,
        field: str | KeyFunction | None = None,
    ) -> None:
        self.redis = redis_client(client)
        self.key = key
        self.value = value
        self.field = None if field is None else key_function(field)
        self._pending: list[bytes | str] = []

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._pending = []
        return super().on_checkpoint_restore(checkpoint)

    def write(self, messages: Sequence[Message]) -> None:
        self._pending.extend(_values(messages, self.value, self.field))

    def on_checkpoint_prepare(self, checkpoint_id: int) -> None:
        values, self._pending = self._pending, []
        step = _CHUNK * (2 if self.field else 1)
        pipe = self.redis.pipeline(transaction=False)
        for i in range(0, len(values), step):
            if self.field is None:
                pipe.rpush(self.key, *values[i : i + step])
            else:
                part = values[i : i + step]
                pipe.hset(self.key, mapping=dict(zip(part[::2], part[1::2], strict=True)))
        pipe.execute()

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        self._pending = []

    def close(self) -> None:
        self.redis.close()


class RedisIdempotentSink(IdempotentSink):
    """Idempotent: each message becomes the key ``<prefix><key>`` set with ``SET … NX`` (and ``EX
    ttl`` if given), so the first write of a key wins and a replayed one changes nothing.

    For create-once effects (an event recorded, a token issued): a later, different value for a key
    is ignored too. ``key`` is a field name of JSON-object messages or a function of the message.
    A checkpoint's keys are sent at *prepare*, in Lua calls of up to 1,000 keys each (one round trip
    instead of one command per key). Those calls name keys of any hash slot: a single Redis, not a
    Redis Cluster (where ``RedisAtomicSink`` with a hash tag is the way).
    """

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        prefix: str,
        key: str | KeyFunction,
        value: ValueFunction = json_value,
        ttl: int | None = None,
    ) -> None:
        super().__init__(key)
        if ttl is not None and ttl <= 0:
            raise ValueError("ttl must be a positive number of seconds, or None")
        self.redis = redis_client(client)
        self.prefix = prefix
        self.value = value
        self.ttl = ttl
        self._script = self.redis.register_script(SETNX_LUA)
        self.last_written = 0

    def write_idempotent(self, records: Sequence[tuple[str, Message]]) -> None:
        ttl = "" if self.ttl is None else str(self.ttl)
        written = 0
        for i in range(0, len(records), _CHUNK):
            part = records[i : i + _CHUNK]
            written += int(
                self._script(keys=[self.prefix + k for k, _ in part], args=[ttl, *(self.value(m) for _, m in part)])
            )
        self.last_written = written

    def close(self) -> None:
        self.redis.close()


class RedisAtomicSink(CheckpointAwareSink):
    """Exactly-once inside Redis: one Lua script writes a checkpoint's values *and* the checkpoint
    (id, offsets) into the hash ``checkpoint_key``, atomically.

    Keys default to ``onceflow:{<job>}:out`` and ``onceflow:{<job>}:checkpoint``: the ``{job}``
    hash tag puts them in one Redis Cluster slot, as a script requires (a ``key`` of your own must
    carry the same tag). The script applies checkpoint N only if the hash still holds the checkpoint
    this runner restored or committed last (else :class:`SinkFencedError`). Values are buffered
    for the checkpoint and sent in that one call.

    A commit whose connection drops or times out before its answer (the script may or may not have
    run) is sent again, as it was, up to ``commit_retries`` times (backoff 0.05 s doubling to 2 s):
    the sink does this itself, whatever retries the redis-py client has (a client built from a
    ``redis://`` URL has none). The resend carries the same per-commit token, so a script that did
    run is recognised and changes nothing (it returns 0); one that did not runs now. When the
    resends are used up, the error is raised and nothing is acknowledged: a rerun restores from
    whatever Redis holds.

    Exactly-once holds as far as Redis keeps what it acknowledged: run it with ``appendonly yes``
    (``appendfsync always`` to survive power loss, not only a crash of Redis).
    """

    atomic = True

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        job: str,
        key: str | None = None,
        checkpoint_key: str | None = None,
        value: ValueFunction = json_value,
        field: str | KeyFunction | None = None,
        commit_retries: int = 5,
    ) -> None:
        if not job:
            raise ValueError("job must name the pipeline (it keys the checkpoint)")
        if commit_retries < 0:
            raise ValueError("commit_retries must be >= 0")
        self.commit_retries = commit_retries
        self.redis = redis_client(client)
        self.job = job
        self.key = key or f"onceflow:{{{job}}}:out"
        self.checkpoint_key = checkpoint_key or f"onceflow:{{{job}}}:checkpoint"
        same_slot(self.key, self.checkpoint_key)
        self.value = value
        self.field = None if field is None else key_function(field)
        self.mode: Literal["list", "hash"] = "list" if field is None else "hash"
        self._script = self.redis.register_script(ATOMIC_LUA)
        self._pending: list[bytes | str] = []
        self._last = 0

    def load_checkpoint(self) -> Checkpoint | None:
        data = self.redis.hgetall(self.checkpoint_key)
        if not data or int(data.get(b"checkpoint", b"0")) == 0:
            return None
        return Checkpoint(
            int(data[b"checkpoint"]),
            json.loads(data[b"offsets"]),
            json.loads(data.get(b"start_offsets", b"{}")),
            None,
            True,
        )

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._pending = []
        self._last = 0 if checkpoint is None else checkpoint.id
        return True

    def write(self, messages: Sequence[Message]) -> None:
        self._pending.extend(_values(messages, self.value, self.field))

    def on_checkpoint_complete(self, checkpoint: Checkpoint) -> None:
        values, self._pending = self._pending, []
        args: list[Any] = [
            checkpoint.id,
            self._last,
            uuid.uuid4().hex,
            json.dumps(checkpoint.offsets),
            json.dumps(checkpoint.start_offsets),
            self.mode,
            *values,
        ]
        resent = 0
        delay = 0.05
        while True:
            try:
                self._script(keys=[self.key, self.checkpoint_key], args=args)
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if resent >= self.commit_retries:
                    exc.add_note(
                        f"job {self.job!r}: checkpoint {checkpoint.id} sent {resent + 1} times without an answer; "
                        "it may or may not be committed (a rerun restores from Redis)"
                    )
                    raise
                log.warning(
                    "job %s: the commit of checkpoint %d got no answer (%r); sending it again",
                    self.job,
                    checkpoint.id,
                    exc,
                )
                resent += 1
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except redis.ResponseError as exc:
                if str(exc).startswith("FENCED"):
                    what = (
                        "an earlier try of it, whose answer was lost, may have been written and then superseded"
                        if resent
                        else "it was not written"
                    )
                    raise SinkFencedError(
                        f"job {self.job!r}: {exc}; checkpoint {checkpoint.id} of this runner: {what}"
                    ) from exc
                raise SinkError(f"job {self.job!r}: the commit script failed: {exc}") from exc
        self._last = checkpoint.id

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        self._pending = []

    def close(self) -> None:
        self.redis.close()
