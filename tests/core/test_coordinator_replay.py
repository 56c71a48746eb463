"""Memory after a replay of the coordinator log equals memory before the crash, whatever the
history (issue 29, item 1's property test; the rule every coordinator record keeps: its meaning is
written once, live and in replay alike).

Random histories of what changes the coordinator's state, run a few requests at a time so that
they interleave (transactions with appends and group offsets, commits by /commit and by their last
append, aborts, plain group commits and rewinds with member epochs, deletions of groups and of
idle ids, streams deleted and created again, which drop offsets into them, a sink's batches and
resets, compactions), then kill -9 (everything staged reached the files) and replay the log:
transactional ids, groups, member epochs, sinks and the epoch floor are what they were."""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.txn import JSON, S, T, Txn, kill, serve
from onceflow.core import batches, groups, txn
from onceflow.core.broker import Broker
from onceflow.core.txn import RECORDS

TIDS = ("t0", "t1", "t2")
GROUPS = ("g0", "g1")
STREAMS = ("a", "b")
OPS = (
    "init",
    "append",
    "offsets",
    "commit",
    "abort",
    "commit_append",
    "group_commit",
    "group_rewind",
    "drop_group",
    "drop_txn",
    "recreate",
    "sink_batch",
    "sink_reset",
    "compact",
)
op = st.tuples(st.sampled_from(OPS), st.integers(0, 2), st.integers(0, 1), st.integers(0, 1))
history = st.lists(st.lists(op, min_size=1, max_size=3), min_size=3, max_size=25)


def state(broker: Broker) -> dict[str, Any]:
    coord = broker.coordinator
    return {
        "txns": {tid: meta.record() for tid, meta in sorted(coord.txns.items())},
        "groups": {g: dict(o) for g, o in sorted(coord.groups.items())},
        "member_epochs": dict(sorted(coord.member_epochs.items())),
        "sinks": dict(sorted(coord.sinks.items())),
        "epoch_floor": coord.epoch_floor,
    }


class Play:
    def __init__(self, c: Any) -> None:
        self.c = c
        self.txns = {tid: Txn(c.client, tid) for tid in TIDS}
        self.member_epoch = 0
        self.batch = 0

    async def tail(self, stream: str) -> str:
        r = await self.c.client.head(S + stream)
        return r.headers.get("stream-next-offset", "-1")

    async def run(self, kind: str, i: int, j: int, k: int) -> None:
        """One request (or two) of ``kind``; refusals are part of the history too."""
        c = self.c.client
        tid, group, stream = TIDS[i], GROUPS[j], STREAMS[k]
        t = self.txns[tid]
        if kind == "init":
            r = await c.post(T + tid + "/init", json={})
            if r.status_code == 200:
                t.epoch, t.txn, t.seqs = r.json()["epoch"], r.json()["txn"], {}
        elif kind == "append":
            await t.send(stream, {"i": i})
        elif kind == "offsets":
            r = await c.post(
                T + tid + "/offsets",
                json={"epoch": t.epoch, "group": group, "offsets": {stream: await self.tail(stream)}},
            )
            if r.status_code == 200:
                t.txn = r.json()["txn"]
        elif kind in ("commit", "abort"):
            await t.end(commit=kind == "commit")
        elif kind == "commit_append":
            await t.send(stream, {"i": i, "last": True}, commit=t.txn + (0 if t.txn else 1))
        elif kind in ("group_commit", "group_rewind"):
            self.member_epoch += 1
            body = {"offsets": {stream: await self.tail(stream)}, "member_epoch": self.member_epoch}
            if kind == "group_rewind":
                body = {"offsets": {stream: "0000000000000000_0000000000000000"}, "reset": True}
            await c.post(f"/v1/groups/{group}/offsets", json=body)
        elif kind == "drop_group":
            await c.delete(f"/v1/groups/{group}")
        elif kind == "drop_txn":
            await c.post(T + tid + "/force-abort", json={})
            await c.delete(T + tid)
        elif kind == "recreate":
            if (await c.delete(S + stream)).status_code == 204:
                await c.put(S + stream, headers=JSON)
        elif kind == "sink_batch":
            self.batch += 1
            begin = {"query": "q", "batch": self.batch, "partition": i, "task": f"task{self.batch}"}
            r = await c.post("/v1/sinks/k/begin", json=begin)
            if r.status_code == 200 and r.json().get("id"):
                task = Txn(c, r.json()["id"])
                task.epoch = r.json()["epoch"]
                w = await task.send(stream, {"batch": self.batch})
                members = [[task.tid, task.epoch, task.txn]] if w.status_code == 200 else []
                await c.post("/v1/sinks/k/commit", json={"query": "q", "batch": self.batch, "members": members})
        elif kind == "sink_reset":
            owner = (await c.get("/v1/sinks/k")).json().get("owner")
            await c.post("/v1/sinks/k/reset", json={"owner": owner})
        else:
            assert kind == "compact"
            coord = self.c.broker.coordinator
            coord.compact_bytes = 0
            await coord.maybe_compact(tries=1)
            coord.compact_bytes = 64 << 20


async def _play(rounds: list[list[tuple[str, int, int, int]]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        async with serve(data) as c:
            for s in STREAMS:
                assert (await c.client.put(S + s, headers=JSON)).status_code == 201
                await c.client.post(S + s, json=[0], headers=JSON)
            play = Play(c)
            for rnd in rounds:
                await asyncio.gather(*(play.run(*o) for o in rnd))
            coord = c.broker.coordinator
            assert coord.log is not None
            await coord.log.drain()
            before = state(c.broker)
            await kill(c.broker)
        again = Broker(data)
        again.open()
        try:
            assert state(again) == before
        finally:
            await kill(again)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history)
def test_replay_gives_back_the_memory_of_any_history(rounds: list[list[tuple[str, int, int, int]]]) -> None:
    asyncio.run(_play(rounds))


def test_every_kind_of_record_written_has_the_one_method_that_applies_it() -> None:
    """Records are written by the coordinator's layers (core/txn.py, groups.py, batches.py); each
    kind is applied by a method of the base, which replay (in the base) runs."""
    source = "".join(Path(m.__file__).read_text() for m in (txn, groups, batches))
    written = set(re.findall(r'"kind": "(\w+)"', source))
    assert written and written <= set(RECORDS), written - set(RECORDS)
    assert all(callable(getattr(txn.Transactions, method, None)) for method in RECORDS.values())
