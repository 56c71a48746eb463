"""onceflow's endpoints beside the Durable Streams protocol: transactions (``/v1/txn/``), consumer
groups (``/v1/groups/``), sinks (``/v1/sinks/``), the stream listing (``/v1/streams``) and the
operator's lists and acts (docs/transactions.md, docs/operations.md). The router
(server/routes.py) names the endpoint; :meth:`Extensions._coordinated` answers it. A mixin of
:class:`~onceflow.server.app.App`, which gives it the broker, the configuration and the request
body (:meth:`App._body`: its coding and its bounds)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from ..core.broker import MAX_NAME_BYTES, Broker, StreamState, validate_name
from ..core.jsonmode import parse_control
from ..core.refusal import Refusal
from ..core.txn import SinkState, TxnMeta, TxnStatus
from ..storage.log import InvalidPosition, OffsetGone
from ..storage.position import Position, parse_token
from ..wire import MAX_SAFE_INT, Coding
from .answering import BadRequest, Readable, Receive, Scope, _json_response, _shown, _utf8, list_prefix, may_read
from .answers import answer_for
from .routes import FORCE_ABORT, GROUPS_LIST_PATH, TXN_LIST_PATH, Route

if TYPE_CHECKING:
    from .app import AppConfig

__all__ = ["Extensions"]


class Extensions:
    broker: Broker
    config: AppConfig

    async def _body(self, headers: dict[str, str], receive: Receive, coding: Coding | None = None) -> bytes:
        raise NotImplementedError  # the app's

    # ------------------------------------------------------------------ transactions (extension)

    async def _json_body(self, headers: dict[str, str], receive: Receive) -> dict[str, Any]:
        raw = await self._body(headers, receive)
        if not raw:
            return {}
        try:
            value = parse_control(raw)
        except ValueError as exc:
            raise BadRequest(f"the body must be a JSON object: {exc}") from None
        except RecursionError:
            raise BadRequest("the body is JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise BadRequest("the body must be a JSON object")
        return value

    @staticmethod
    def _int_field(body: dict[str, Any], key: str) -> int:
        value = body.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SAFE_INT:
            raise BadRequest(f"the body needs {key!r}: an integer from 0 to 2^53-1")
        return value

    def _offsets_field(self, body: dict[str, Any]) -> dict[str, str]:
        """A body's ``offsets``: positions this server issued, in streams that exist (each is kept in
        the coordinator, its log, every listing and scrape: a name is capped as every name is, and
        a commit can name no more streams than there are)."""
        offsets = body.get("offsets")
        if not isinstance(offsets, dict) or not offsets:
            raise BadRequest('the body needs "offsets": {"<stream>": "<offset>", ...}')
        for stream, off in offsets.items():
            if not _utf8(stream):
                raise BadRequest(f"stream name {stream!r} in offsets is not valid UTF-8 (a lone surrogate escape)")
            wrong = validate_name(stream)
            if wrong is not None:
                raise BadRequest(f"{wrong}: {stream[:80]!r} in offsets")
            if not isinstance(off, str) or parse_token(off) is None:
                raise BadRequest(f"offset for {stream!r} is not an offset this server issued: {off!r}")
        missing = [s for s in offsets if (found := self.broker.get(s)) is None or found.meta.soft_deleted]
        if missing:
            shown = ", ".join(repr(s) for s in missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise BadRequest(f"offsets name streams that do not exist: {shown}", 404, "not_found")
        return offsets

    @staticmethod
    def _group_name(group: str) -> str:
        if len(group.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise BadRequest(f"a group name is at most {MAX_NAME_BYTES} bytes, as every name is")
        return group

    async def _coordinated(
        self, r: Route, method: str, headers: dict[str, str], receive: Receive, scope: Scope
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``/v1/txn/``, ``/v1/groups/`` and ``/v1/sinks/``: transactional ids, consumer groups and
        sinks (docs/transactions.md), each endpoint as the router named it."""
        if r.refused is not None:  # txn.other, group.other, sink.other
            status, message, allow = r.refused
            code = "method_not_allowed" if status == 405 else "not_found"
            raise BadRequest(message, status, code, ((b"allow", allow.encode()),) if allow else ())
        coord = self.broker.coordinator
        readable = may_read(scope)
        if r.key.startswith("txn."):
            tid = r.name
            if not tid or validate_name(tid):
                raise BadRequest("use /v1/txn/<transactional id>/(init|commit|abort|offsets)", 404, "not_found")
            if r.key == "txn.delete":
                if not await coord.drop_txn(tid):
                    raise BadRequest(f"transactional id {tid!r} was never initialised", 404, "unknown_transactional_id")
                return 204, [], b""
            if r.key == "txn.read":
                meta = coord.txns.get(tid)
                if meta is None:
                    raise BadRequest(f"transactional id {tid!r} was never initialised", 404, "not_found")
                return _json_response(200, self._txn_state(meta, readable))
            return await self._txn_action(tid, r.action, await self._json_body(headers, receive), readable)
        if r.key.startswith("group."):
            if r.key == "group.delete":  # the group itself may contain '/'
                if not r.name or not await coord.drop_group(self._group_name(r.name)):
                    raise BadRequest(
                        f"no group named {r.name!r} (it has no offsets and no member epoch)", 404, "not_found"
                    )
                return 204, [], b""
            group = self._group_name(r.name)
            if r.key == "group.reset":
                return await self._reset_group(group, await self._json_body(headers, receive), readable)
            if r.key == "group.commit":
                body = await self._json_body(headers, receive)
                member_epoch = body.get("member_epoch")
                if member_epoch is not None:
                    member_epoch = self._int_field(body, "member_epoch")
                await coord.commit_offsets(
                    group, self._offsets_field(body), member_epoch=member_epoch, reset=body.get("reset") is True
                )
            return _json_response(200, {"group": group, "offsets": _shown(coord.groups.get(group, {}), readable)})
        sink = r.name  # the sink id may contain '/': a POST's action is the last segment of the path
        if not sink or validate_name(sink):
            raise BadRequest(
                "use /v1/sinks/<sink id> or /v1/sinks/<sink id>/(begin|alive|commit|abort|reset)", 404, "not_found"
            )
        if r.key == "sink.read":
            return _json_response(200, _sink_json(sink, coord.sinks.get(sink)))
        return await self._sink_action(sink, r.action, await self._json_body(headers, receive))

    async def _txn_action(
        self, tid: str, action: str, body: dict[str, Any], readable: Readable
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``POST /v1/txn/<tid>/<action>``."""
        coord = self.broker.coordinator
        if action == FORCE_ABORT:
            return await self._force_abort(tid, body, readable)
        if action == "init":
            timeout_ms = body.get("timeout_ms")
            if timeout_ms is not None and (
                not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or not 1 <= timeout_ms <= 3_600_000
            ):
                raise BadRequest('"timeout_ms" must be an integer from 1 to 3600000')
            request_id = body.get("request_id")
            if request_id is not None and (not isinstance(request_id, str) or not 1 <= len(request_id) <= 200):
                raise BadRequest(
                    '"request_id" must be a string of 1 to 200 characters (the same for every retry of one init)'
                )
            expected = self._int_field(body, "expected_epoch") if body.get("expected_epoch") is not None else None
            meta = await coord.init(
                tid, timeout_ms / 1000 if timeout_ms else None, request_id=request_id, expected_epoch=expected
            )
            return _json_response(200, _txn_json(meta, readable))
        if action in ("commit", "abort"):
            meta = await coord.end(
                tid, self._int_field(body, "epoch"), self._int_field(body, "txn"), commit=action == "commit"
            )
            return _json_response(200, _txn_json(meta, readable))
        if action == "offsets":
            group = body.get("group")
            if not isinstance(group, str) or not group or not _utf8(group):
                raise BadRequest('the body needs "group": a non-empty string of valid UTF-8')
            self._group_name(group)
            txn = self._int_field(body, "txn") if body.get("txn") is not None else None
            meta = await coord.add_offsets(
                tid, self._int_field(body, "epoch"), group, self._offsets_field(body), txn=txn
            )
            return _json_response(200, _txn_json(meta, readable))
        raise AssertionError(f"the router gave txn action {action!r}")  # pragma: no cover

    async def _sink_action(
        self, sink: str, action: str, body: dict[str, Any]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        coord = self.broker.coordinator
        query = self._name_field(body, "query")
        batch = self._int_field(body, "batch") if body.get("batch") is not None else None
        if action == "reset":
            if "owner" not in body:
                raise BadRequest(
                    'a reset needs "owner": the query the sink belongs to now (GET /v1/sinks/<sink> shows it), or null'
                )
            await coord.reset_sink(sink, self._name_field(body, "owner"))
            return _json_response(200, {"sink": sink, "status": "reset", "batch": None, "owner": None})
        if action == "alive":
            kept = coord.keep_alive(sink, query, batch)
            return _json_response(200, {"sink": sink, "kept": kept})
        if action == "begin":
            task = self._name_field(body, "task")
            if task is None:
                raise BadRequest(
                    'a task needs "task": a name of this task attempt (the same for every retry of one begin)'
                )
            timeout_ms = body.get("timeout_ms")
            if timeout_ms is not None and (
                not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or not 1 <= timeout_ms <= 3_600_000
            ):
                raise BadRequest('"timeout_ms" must be an integer from 1 to 3600000')
            meta, state = await coord.begin_task(
                sink,
                partition=self._int_field(body, "partition"),
                task=task,
                batch=batch,
                query=query,
                txn_timeout=timeout_ms / 1000 if timeout_ms else None,
            )
            out = _sink_json(sink, state)
            if meta is None:
                # a replay: the task writes nothing; with a fingerprint recorded for this very batch it
                # still reports the fingerprint of its rows, so the commit can tell the input is the same
                check = state is not None and state.batch == batch and state.fingerprint is not None
                return _json_response(200, {**out, "status": "already_committed", "verify": check})
            return _json_response(
                200,
                {
                    **out,
                    "status": "write",
                    "id": meta.tid,
                    "producer_id": meta.producer_id,
                    "epoch": meta.epoch,
                    "txn": meta.txn,
                },
            )
        raw_members = body.get("members")
        if not isinstance(raw_members, list):
            raise BadRequest('the body needs "members": a list of {"id": ..., "epoch": ..., "txn": ...}')
        members: list[tuple[str, int, int]] = []
        for m in raw_members:
            if not isinstance(m, dict) or not isinstance(m.get("id"), str) or validate_name(m["id"]):
                raise BadRequest(f'each member needs "id" (a transactional id), "epoch" and "txn"; got {m!r}')
            members.append((m["id"], self._int_field(m, "epoch"), self._int_field(m, "txn")))
        prefix = body.get("abort_prefix")
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise BadRequest('"abort_prefix" must be a non-empty string')
        if action == "abort":
            await coord.abort_members(sink, members, prefix, query=query, batch=batch)
            return _json_response(
                200, {"sink": sink, "status": "aborted", "batch": _sink_json(sink, coord.sinks.get(sink))["batch"]}
            )
        fingerprint = self._name_field(body, "fingerprint")
        rows = self._int_field(body, "rows") if body.get("rows") is not None else None
        committed, last = await coord.commit_members(
            sink, batch, members, prefix, query=query, fingerprint=fingerprint, rows=rows
        )
        return _json_response(
            200, {"sink": sink, "status": "committed" if committed else "already_committed", "batch": last}
        )

    @staticmethod
    def _name_field(body: dict[str, Any], key: str) -> str | None:
        value = body.get(key)
        if value is not None and (
            not isinstance(value, str)
            or not 1 <= len(value) <= 200
            or any(ord(c) < 0x20 for c in value)
            or not _utf8(value)
        ):
            raise BadRequest(f'"{key}" must be a string of 1 to 200 printable characters, or null')
        return value

    # ------------------------------------------------------------------ list (extension)

    def _list(self, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        prefix = list_prefix(scope)
        streams = [self._stream_json(s) for s in self.broker.list(prefix)]
        body = json.dumps({"streams": streams}, separators=(",", ":")).encode()
        return 200, [(b"content-type", b"application/json"), (b"cache-control", b"no-store")], body

    def _stream_json(self, s: StreamState) -> dict[str, object]:
        """One stream of the listing (docs/protocol.md, docs/operations.md)."""
        start, tail = s.earliest, s.tail
        keep_seconds, keep_bytes = self.broker.retention_of(s)  # in force: the stream's own, else the server's
        return {
            "name": s.name,
            "content_type": s.meta.content_type,
            "next_offset": tail.token(),
            "stable_offset": s.stable().token(),
            "closed": s.closed,
            "start_offset": start.token(),
            "messages": tail.offset - start.offset,
            "bytes": tail.pos - start.pos,
            "created_ms": s.meta.created_ms,
            "ttl_seconds": s.meta.ttl_seconds,
            "expires_at": s.meta.expires_at,
            "forked_from": s.meta.fork_parent,
            "producers": len(s.log.producers),
            "open_transactions": len(s.log.txn.open),
            "retention_seconds": keep_seconds,
            "retention_bytes": keep_bytes,
            "retention_keep_groups": s.meta.retention_keep_groups,
        }

    # ------------------------------------------------------------------ operator endpoints (extension)

    def _admin_list(self, path: str, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``GET /v1/txn``, ``/v1/groups`` and ``/v1/sinks`` (docs/operations.md): everything whose
        name starts with the ``prefix`` parameter, sorted by name."""
        params = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        prefix = list_prefix(scope)
        readable = may_read(scope)
        coord = self.broker.coordinator
        if path == TXN_LIST_PATH:
            raw_open = params.get("open", ["false"])[0]
            if raw_open not in ("true", "false"):
                raise BadRequest(f"open must be true or false, got {raw_open!r}")
            txns = [
                self._txn_detail(m, readable)
                for tid, m in sorted(coord.txns.items())
                if tid.startswith(prefix) and m.epoch >= 0 and (raw_open == "false" or _is_open(m))
            ]
            return _json_response(200, {"transactions": txns})
        if path == GROUPS_LIST_PATH:
            names = sorted(g for g in set(coord.groups) | set(coord.member_epochs) if g.startswith(prefix))
            return _json_response(200, {"groups": [self._group_lag(g, readable) for g in names]})
        sinks = [_sink_json(name, state) for name, state in sorted(coord.sinks.items()) if name.startswith(prefix)]
        return _json_response(200, {"sinks": sinks})

    @staticmethod
    def _txn_state(meta: TxnMeta, readable: Readable) -> dict[str, object]:
        """``GET /v1/txn/<id>``: the id's state, whether a transaction is open (or decided and not
        finished: either holds the last stable offset of its streams), and the groups whose
        offsets it carries."""
        return {
            **_txn_json(meta, readable),
            "open": _is_open(meta),
            "groups": sorted(g for g in meta.offsets if readable(g)),
        }

    def _txn_detail(self, meta: TxnMeta, readable: Readable) -> dict[str, object]:
        """A row of ``GET /v1/txn``: the id's state and, for an open transaction, ``open_ms``: the
        time its timeout counts (since it began, the server's last start, or a sink task's last
        keep-alive, whichever is latest)."""
        age = self.broker.coordinator.clock.monotonic() - meta.started
        return {**self._txn_state(meta, readable), "open_ms": int(age * 1000) if _is_open(meta) else None}

    def _group_lag(self, group: str, readable: Readable) -> dict[str, object]:
        """A group's committed offset in each stream, the stream's ends, and the lag: messages
        (records) from the committed offset to the last stable offset, which is what a
        read_committed consumer of the group has still to read (records of aborted transactions
        in between included); ``lag_bytes`` is the same distance in log bytes. Both are None
        when the stream is gone or the offset is not one of its positions (past its tail). An
        offset whose data retention deleted (``offset_gone``) counts from the earliest offset
        kept: what is gone cannot be read any more. Only streams the request may read are shown;
        ``hidden_streams`` counts the others, and the lag is that of the streams shown."""
        coord = self.broker.coordinator
        streams: list[dict[str, object]] = []
        total: int | None = None
        held = coord.groups.get(group, {})
        shown = _shown(held, readable)
        for name, token in sorted(shown.items()):
            entry: dict[str, object] = {
                "stream": name,
                "offset": token,
                "next_offset": None,
                "stable_offset": None,
                "lag": None,
                "lag_bytes": None,
                "offset_gone": False,
            }
            s = self.broker.get(name)
            at = parse_token(token)
            if s is not None and not s.meta.soft_deleted and at is not None:
                stable, tail, earliest = s.stable(), s.tail, s.earliest
                entry["next_offset"], entry["stable_offset"] = tail.token(), stable.token()
                if at.pos < earliest.pos:
                    entry["offset_gone"] = True
                    at = earliest
                if at.pos <= tail.pos and at.offset <= tail.offset:
                    entry["lag"] = max(0, stable.offset - at.offset)
                    entry["lag_bytes"] = max(0, stable.pos - at.pos)
                    total = (total or 0) + max(0, stable.offset - at.offset)
            streams.append(entry)
        return {
            "group": group,
            "member_epoch": coord.member_epochs.get(group),
            "lag": total,
            "streams": streams,
            "hidden_streams": len(held) - len(shown),
        }

    async def _force_abort(
        self, tid: str, body: dict[str, Any], readable: Readable
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``POST /v1/txn/<id>/force-abort``: an operator aborts the id's open transaction and
        fences its epoch (:meth:`~onceflow.core.coordinator.Coordinator.abort_open`)."""
        epoch = self._int_field(body, "epoch") if body.get("epoch") is not None else None
        txn = self._int_field(body, "txn") if body.get("txn") is not None else None
        aborted_epoch, aborted_txn = await self.broker.coordinator.abort_open(tid, epoch=epoch, txn=txn)
        meta = self.broker.coordinator.txns[tid]
        return _json_response(
            200, {**self._txn_state(meta, readable), "aborted": {"epoch": aborted_epoch, "txn": aborted_txn}}
        )

    async def _reset_group(
        self, group: str, body: dict[str, Any], readable: Readable
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``POST /v1/groups/<group>/reset``: move the group's offsets to the start of each stream
        (``earliest``), its last stable offset (``latest``), given offsets (``offsets``) or the
        first batch appended at or after ``time_ms`` (``time``), with one reset commit (or, with
        ``dry_run``, only say where they would go).

        A reset by time moves at most ``max_time_reset_streams`` streams (a 400 before any lookup
        otherwise) and pauses for the event loop between two streams' lookups
        (:meth:`~onceflow.core.broker.Broker.position_at_time`): one request's work is bounded by
        its size, and other requests are served meanwhile. A stream deleted during those pauses
        fails the reset (404) rather than have its offset committed for whatever stream of that
        name may exist by then."""
        to = body.get("to")
        if to not in ("earliest", "latest", "offsets", "time"):
            raise BadRequest('the body needs "to": "earliest", "latest", "offsets" or "time"')
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise BadRequest('"dry_run" must be true or false')
        coord = self.broker.coordinator
        before = dict(coord.groups.get(group, {}))  # a copy: the commit below changes the group in place
        wanted: dict[str, str] = {}
        if to == "offsets":
            if body.get("streams") is not None:
                raise BadRequest('a reset to "offsets" names its streams in "offsets", not in "streams"')
            wanted = self._offsets_field(body)
            names = list(wanted)
        else:
            names = self._reset_streams(body, before, group, readable)
        time_ms = self._int_field(body, "time_ms") if to == "time" else None
        if to != "time" and body.get("time_ms") is not None:
            raise BadRequest('"time_ms" goes with "to": "time" only')
        cap = self.config.max_time_reset_streams
        if to == "time" and len(names) > cap:
            which = (
                f"this one names {len(names)}"
                if body.get("streams") is not None
                else (f"group {group!r} has offsets in {len(names)}")
            )
            raise BadRequest(
                f'a reset by time moves at most {cap} streams ({which}): name them in "streams", in parts '
                f"of at most {cap} (--stream of onceflow groups reset); nothing was reset"
            )
        new: dict[str, str] = {}
        found: list[StreamState] = []
        for name in names:
            s = self.broker.get(name)
            if s is None or s.meta.soft_deleted:
                raise BadRequest(f"no stream named {name!r}: nothing was reset", 404, "not_found")
            new[name] = (await self._reset_position(s, to, wanted.get(name), time_ms)).token()
            found.append(s)
        for s in found:  # a lookup by time pauses: a stream may have been deleted (and made anew) since
            if self.broker.get(s.name) is not s or s.meta.soft_deleted:
                raise BadRequest(
                    f"stream {s.name!r} was deleted while the reset ran: nothing was reset", 404, "not_found"
                )
        if not dry_run:
            await coord.commit_offsets(group, new, reset=True)
        return _json_response(
            200,
            {
                "group": group,
                "to": to,
                "dry_run": dry_run,
                "offsets": new,
                "previous": {name: before.get(name) for name in new},
            },
        )

    async def _reset_position(self, s: StreamState, to: str, offset: str | None, time_ms: int | None) -> Position:
        """Where a reset ``to`` earliest, latest, an ``offset`` or ``time_ms`` puts a group in ``s``."""
        if to == "earliest":
            return s.earliest  # where a read from -1 starts: the start, or where retention left it
        if to == "latest":
            return s.stable()
        if to == "offsets":
            assert offset is not None
            try:
                at = self.broker.resolve_start(s, offset)
            except OffsetGone as exc:
                gone = answer_for(Refusal.OFFSET_GONE)
                raise BadRequest(
                    f"offset for stream {s.name!r}: {exc}; nothing was reset", gone.status, gone.code
                ) from None
            if isinstance(at, str):
                raise BadRequest(f"offset for stream {s.name!r}: {at}; nothing was reset")
            return at
        assert time_ms is not None
        try:
            return await self.broker.position_at_time(s, time_ms)
        except OffsetGone as exc:  # retention deleted what the scan was reading
            gone = answer_for(Refusal.OFFSET_GONE)
            raise BadRequest(f"stream {s.name!r}: {exc}; nothing was reset", gone.status, gone.code) from None
        except InvalidPosition as exc:
            raise BadRequest(f"{exc}: nothing was reset", 404, "not_found") from None

    @staticmethod
    def _reset_streams(body: dict[str, Any], committed: dict[str, str], group: str, readable: Readable) -> list[str]:
        """The streams a reset moves: ``streams`` in the body (the guard checked them), else every
        stream the group has committed an offset in, each of which the request must be allowed to
        read (the guard cannot see them in the request; they are not named in the refusal)."""
        raw = body.get("streams")
        if raw is None:
            if not committed:
                raise BadRequest(
                    f'group {group!r} has no committed offsets: name the streams to reset ("streams"; '
                    "--stream of onceflow groups reset)"
                )
            hidden = len(committed) - len(_shown(committed, readable))
            if hidden:
                raise BadRequest(
                    f"group {group!r} holds offsets in {hidden} stream(s) this token may not read: "
                    'name the streams to reset ("streams"; --stream of onceflow groups reset)',
                    403,
                    "forbidden",
                )
            return sorted(committed)
        if not isinstance(raw, list) or not raw or not all(isinstance(n, str) and n for n in raw):
            raise BadRequest('"streams" must be a non-empty list of stream names')
        return list(dict.fromkeys(raw))


def _txn_json(meta: TxnMeta, readable: Readable) -> dict[str, object]:
    return {
        "transactional_id": meta.tid,
        "producer_id": meta.producer_id,
        "epoch": meta.epoch,
        "txn": meta.txn,
        "status": meta.status.value,
        "streams": sorted(n for n in meta.streams if readable(n)),
        "timeout_ms": int(meta.timeout * 1000),
    }


def _sink_json(sink: str, state: SinkState | None) -> dict[str, object]:
    """What ``GET /v1/sinks/<sink>`` shows: the last committed batch and the query owning the sink."""
    return {
        "sink": sink,
        "batch": state.batch if state else None,
        "owner": state.owner if state else None,
        "rows": state.rows if state else None,  # of its last committed batch, as its writers counted them
    }


def _is_open(meta: TxnMeta) -> bool:
    """A transaction is open (or decided and not finished yet): it holds the LSO of its streams."""
    return meta.status in (TxnStatus.ONGOING, TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT)
