"""The chaos history checker finds each kind of anomaly in hand-made histories and passes a clean one."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from onceflow_tools.chaos.history import ANOMALY_KINDS, HistoryWriter, check, load_history, main


def tok(offset: int) -> str:
    return f"{offset:016d}_{offset * 10:016d}"


class H:
    """A hand-made history: helpers append operations with increasing timestamps."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []
        self.t = 0.0

    def op(self, client: str, op: str, **fields: Any) -> None:
        self.t += 1.0
        self.ops.append({"client": client, "op": op, "t": self.t, **fields})

    def append(
        self,
        client: str,
        op_id: int,
        stream: str,
        values: list[Any],
        *,
        offset: int | None = None,
        txn: str | None = None,
        ack: str | None = "ok",
    ) -> None:
        self.op(client, "append", id=op_id, stream=stream, values=values, **({"txn": txn} if txn else {}))
        if ack is not None:
            self.op(client, "ack", id=op_id, outcome=ack, **({"offset": offset} if offset is not None else {}))

    def read(
        self,
        client: str,
        stream: str,
        records: list[tuple[int, Any]],
        *,
        start: int = 0,
        final: bool = False,
        isolation: str = "read_committed",
    ) -> None:
        nxt = (max(o for o, _ in records) + 1) if records else start
        self.op(
            client,
            "read",
            stream=stream,
            isolation=isolation,
            start=tok(start),
            next=tok(nxt),
            records=[[o, v] for o, v in records],
            **({"final": True} if final else {}),
        )


def v(client: str, n: int) -> dict[str, Any]:
    return {"c": client, "n": n}


EVENTS = [
    {"id": 1, "user": "u1", "amount": 10.0},
    {"id": 2, "user": "u2", "amount": 5.0},
    {"id": 3, "user": "u1", "amount": 1.5},
]


def enriched(e: dict[str, Any], offset: int) -> dict[str, Any]:
    return {**e, "tier": "small", "source_offset": offset}


def clean() -> H:
    """Two producers, an indeterminate append, a committed and an aborted transaction, a copier, a group,
    a sink into a target outside the server, and a Spark pipeline."""
    h = H()
    h.append("p1", 1, "a", [v("p1", 0), v("p1", 1)], offset=0)
    h.append("p2", 1, "a", [v("p2", 0)], offset=2)
    h.append("p2", 2, "a", [v("p2", 1)], ack=None)  # lost ack: may be stored (it is, once)
    h.append("t", 1, "b", [v("t", 0)], txn="t:1")
    h.append("t", 2, "c", [v("t", 1)], txn="t:1")
    h.op("t", "txn", txn="t:1", decision="commit", outcome="ok")
    h.append("t", 3, "b", [v("t", 2)], txn="t:2")
    h.op("t", "txn", txn="t:2", decision="abort", outcome="ok")
    h.read("r", "a", [(0, v("p1", 0)), (1, v("p1", 1))])
    h.read("r", "a", [(2, v("p2", 0)), (3, v("p2", 1))], start=2)
    h.read("r", "b", [(0, v("t", 0))])  # offset 1 held the aborted value: skipped by read_committed
    h.op("g", "commit-offset", group="g", stream="a", offset=tok(2), outcome="ok")
    h.op("g", "fetch-offsets", group="g", offsets={"a": tok(2)}, t0=h.t + 0.5)
    h.op("g", "commit-offset", group="g", stream="a", offset=tok(4), outcome="ok")
    h.op("g", "fetch-offsets", group="g", offsets={"a": tok(4)}, t0=h.t + 0.5)
    h.op("run", "copy", inputs=["a"], outputs=["x", "y"])
    h.read("final", "a", [(0, v("p1", 0)), (1, v("p1", 1)), (2, v("p2", 0)), (3, v("p2", 1))], final=True)
    h.read("final", "b", [(0, v("t", 0))], final=True)
    h.read("final", "c", [(0, v("t", 1))], final=True)
    h.read("final", "x", [(0, v("p1", 0)), (1, v("p2", 1))], final=True)
    h.read("final", "y", [(0, v("p2", 0)), (1, v("p1", 1))], final=True)
    # a sink of a into a Redis list, in its own order
    h.op("run", "copy", inputs=["a"], outputs=["redis:s"])
    h.op("run", "target", name="redis:s", values=[v("p1", 0), v("p2", 0), v("p1", 1), v("p2", 1)])
    # a pipeline: events e enriched into en, running counts per user in cn (the last per user counts)
    h.op("run", "pipeline", events="e", enriched="en", counts="cn")
    h.read("final", "e", list(enumerate(EVENTS)), final=True)
    h.read("final", "en", [(i, enriched(e, i)) for i, e in enumerate(EVENTS)], final=True)
    h.read(
        "final",
        "cn",
        [
            (0, {"user": "u1", "events": 1, "amount": 10.0}),
            (1, {"user": "u2", "events": 1, "amount": 5.0}),
            (2, {"user": "u1", "events": 2, "amount": 11.5}),
        ],
        final=True,
    )
    return h


def replace_target(h: H, values: list[Any]) -> H:
    h.ops = [o for o in h.ops if o["op"] != "target"]
    h.op("run", "target", name="redis:s", values=values)
    return h


def replace_final(h: H, stream: str, records: list[tuple[int, Any]]) -> H:
    h.ops = [o for o in h.ops if not (o["op"] == "read" and o.get("final") and o["stream"] == stream)]
    h.read("final", stream, records, final=True)
    return h


def kinds(h: H) -> set[str]:
    return {a.kind for a in check(h.ops).anomalies}


def test_a_clean_history_passes() -> None:
    result = check(clean().ops)
    assert result.ok, result.anomalies
    assert result.values_checked >= 8
    assert result.ops["append"] == 6


def test_lost_acknowledged_write() -> None:
    h = clean()
    h.append("p3", 1, "a", [v("p3", 0)], offset=4)  # acknowledged, but the final read ends at offset 3
    assert kinds(h) == {"lost-write"}


def test_an_unacknowledged_missing_write_is_not_a_loss() -> None:
    h = clean()
    h.append("p3", 1, "a", [v("p3", 0)], ack=None)
    h.append("p3", 2, "a", [v("p3", 1)], ack="fail")
    assert check(h.ops).ok


def test_lost_committed_transaction() -> None:
    h = clean()
    h.ops = [o for o in h.ops if not (o["op"] == "read" and o["stream"] == "c")]
    h.read("final", "c", [], final=True)
    assert "lost-write" in kinds(h)


def test_duplicate_in_a_stream() -> None:
    h = clean()
    h.ops = [o for o in h.ops if not (o["op"] == "read" and o.get("final") and o["stream"] == "a")]
    h.read(
        "final", "a", [(0, v("p1", 0)), (1, v("p1", 1)), (2, v("p2", 0)), (3, v("p2", 1)), (4, v("p2", 1))], final=True
    )
    assert kinds(h) == {"duplicate"}


def test_duplicate_across_copy_outputs() -> None:
    h = clean()
    h.read("final", "x", [(0, v("p1", 0)), (1, v("p2", 1)), (2, v("p1", 1))], final=True)
    assert "duplicate" in kinds(h)


def test_a_sink_target_missing_an_input_value_is_a_loss() -> None:
    h = replace_target(clean(), [v("p1", 0), v("p2", 0), v("p1", 1)])  # p2/1 never reached Redis
    assert kinds(h) == {"lost-write"}


def test_a_value_twice_in_a_sink_target_is_a_duplicate() -> None:
    h = replace_target(clean(), [v("p1", 0), v("p2", 0), v("p1", 1), v("p2", 1), v("p1", 1)])
    assert kinds(h) == {"duplicate"}


def test_a_sink_target_holding_aborted_data_is_an_aborted_read() -> None:
    h = replace_target(
        clean(), [v("p1", 0), v("t", 2), v("p2", 0), v("p1", 1), v("p2", 1)]
    )  # t:2 (aborted) is in no input
    assert kinds(h) == {"aborted-read"}


def test_a_sink_whose_target_was_not_read_back_is_skipped_with_a_note() -> None:
    h = clean()
    h.ops = [o for o in h.ops if o["op"] != "target"]
    result = check(h.ops)
    assert result.ok and any("redis:s" in n for n in result.notes)


def test_an_event_enriched_twice_is_a_duplicate() -> None:
    h = replace_final(
        clean(),
        "en",
        [
            (0, enriched(EVENTS[0], 0)),
            (1, enriched(EVENTS[1], 1)),
            (2, enriched(EVENTS[2], 2)),
            (3, enriched(EVENTS[1], 1)),
        ],
    )  # a batch written again
    result = check(h.ops)
    assert {a.kind for a in result.anomalies} == {"duplicate"}
    assert any("event 2 was enriched 2 times" in a.detail for a in result.anomalies)


def test_an_event_never_enriched_is_a_loss() -> None:
    h = replace_final(clean(), "en", [(0, enriched(EVENTS[0], 0)), (1, enriched(EVENTS[2], 2))])
    assert kinds(h) == {"lost-write"}


def test_an_enriched_event_not_in_the_input_is_an_aborted_read() -> None:
    h = replace_final(
        clean(),
        "en",
        [
            *((i, enriched(e, i)) for i, e in enumerate(EVENTS)),
            (3, enriched({"id": 9, "user": "u2", "amount": 1.0}, 9)),
        ],
    )
    assert kinds(h) == {"aborted-read"}


def test_a_wrong_running_count_is_a_wrong_aggregate() -> None:
    h = replace_final(
        clean(),
        "cn",
        [
            (0, {"user": "u1", "events": 1, "amount": 10.0}),
            (1, {"user": "u2", "events": 1, "amount": 5.0}),
            (2, {"user": "u1", "events": 3, "amount": 11.5}),
        ],
    )  # an event counted twice
    assert kinds(h) == {"wrong-aggregate"}


def test_a_pipeline_whose_output_was_not_read_back_is_skipped_with_a_note() -> None:
    h = clean()
    h.ops = [o for o in h.ops if not (o["op"] == "read" and o["stream"] == "cn")]
    result = check(h.ops)
    assert result.ok and any("pipeline" in n for n in result.notes)


def test_copy_that_missed_an_input_is_a_loss() -> None:
    h = clean()
    h.read("final", "y", [(0, v("p2", 0))], final=True)  # replaces y: p1/1 is in no output
    assert "lost-write" in kinds(h)


def test_aborted_read_of_an_aborted_transaction() -> None:
    h = clean()
    h.read("r", "b", [(0, v("t", 0)), (1, v("t", 2))])  # t:2 was aborted
    assert "aborted-read" in kinds(h)


def test_aborted_transaction_in_the_final_log() -> None:
    h = clean()
    h.read("final", "b", [(0, v("t", 0)), (1, v("t", 2))], final=True)
    assert "aborted-read" in kinds(h)


def test_a_read_uncommitted_reader_may_see_aborted_data() -> None:
    h = clean()
    h.read("r", "b", [(0, v("t", 0)), (1, v("t", 2))], isolation="read_uncommitted")
    assert check(h.ops).ok


def test_partial_transaction() -> None:
    h = clean()
    h.append("t", 4, "b", [v("t", 3)], txn="t:3")
    h.append("t", 5, "c", [v("t", 4)], txn="t:3")  # outcome unknown: all or nothing, here only half
    h.read("final", "b", [(0, v("t", 0)), (2, v("t", 3))], final=True)
    assert kinds(h) == {"partial-transaction"}


def test_non_monotonic_offsets_within_a_read() -> None:
    h = clean()
    h.op(
        "r",
        "read",
        stream="a",
        isolation="read_committed",
        start=tok(0),
        next=tok(2),
        records=[[1, v("p1", 1)], [0, v("p1", 0)]],
    )
    assert kinds(h) == {"non-monotonic-read"}


def test_offsets_outside_the_read_range() -> None:
    h = clean()
    h.op("r", "read", stream="a", isolation="read_committed", start=tok(2), next=tok(3), records=[[0, v("p1", 0)]])
    assert kinds(h) == {"non-monotonic-read"}


def test_same_offset_with_two_values() -> None:
    h = clean()
    h.read("r2", "a", [(0, v("p2", 0))])  # offset 0 held p1/0 before
    assert "offset-conflict" in kinds(h)


def test_acknowledged_offset_contradicted_by_a_read() -> None:
    h = clean()
    h.append("p3", 1, "a", [v("p3", 0)], offset=1)  # the server said offset 1, which holds p1/1
    assert "offset-conflict" in kinds(h)


def test_committed_offset_moving_backwards() -> None:
    h = clean()
    h.op("g", "fetch-offsets", group="g", offsets={"a": tok(2)}, t0=h.t + 0.5)  # after 4 was committed
    assert kinds(h) == {"offset-backwards"}


def test_acknowledged_commits_going_backwards() -> None:
    h = clean()
    h.op("g", "commit-offset", group="g", stream="a", offset=tok(3), outcome="ok")
    assert kinds(h) == {"offset-backwards"}


def test_a_fetch_that_overlapped_the_commit_may_see_the_older_offset() -> None:
    h = clean()
    acked = max(o["t"] for o in h.ops if o["op"] == "commit-offset")
    h.op("g", "fetch-offsets", group="g", offsets={"a": tok(2)}, t0=acked - 0.5)  # sent before 4 was acknowledged
    assert check(h.ops).ok


def stale_read(h: H, *, sent: float, up_to_date: bool = True) -> H:
    """A read of stream a from offset 2, sent at ``sent``, that ends at offset 3 (it misses offset 3)."""
    h.op(
        "r",
        "read",
        stream="a",
        isolation="read_committed",
        start=tok(2),
        next=tok(3),
        records=[[2, v("p2", 0)]],
        t0=sent,
        **({"up_to_date": True} if up_to_date else {}),
    )
    return h


def test_a_read_that_misses_an_append_acknowledged_before_it_was_sent_is_stale() -> None:
    """Up to date, sent after the append at offset 3 was acknowledged, yet ending before it: a server
    answered from a view older than an acknowledged write (a deposed leader reading from its memory)."""
    h = clean()
    h.op("p2", "ack", id=2, outcome="ok", offset=3)  # p2's append at offset 3 (indeterminate in clean())
    assert kinds(stale_read(h, sent=h.t + 0.5)) == {"stale-read"}


def test_a_read_sent_before_the_acknowledgement_or_not_up_to_date_may_miss_it() -> None:
    h = clean()
    h.op("p2", "ack", id=2, outcome="ok", offset=3)
    stale_read(h, sent=h.t - 0.5)  # sent before p2's append at offset 3 was acknowledged
    stale_read(h, sent=h.t + 0.5, up_to_date=False)  # a part of the stream (max_bytes), not its end
    assert check(h.ops).ok


def test_the_report_counts_every_kind_and_shows_the_details() -> None:
    h = clean()
    h.append("p3", 1, "a", [v("p3", 0)], offset=4)
    h.read("r", "b", [(0, v("t", 0)), (1, v("t", 2))])
    out = io.StringIO()
    check(h.ops).report(out)
    text = out.getvalue()
    for kind in ANOMALY_KINDS:
        assert f"{kind} " in text
    assert "lost-write 1" in text and '{"c":"p3","n":0}' in text and "FAILED" in text


def test_writer_files_round_trip_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    with HistoryWriter(tmp_path / "p1.jsonl", "p1") as w:
        w.record("append", id=w.next_id(), stream="a", values=[1])
        w.record("ack", id=1, outcome="ok", offset=0)
    with open(tmp_path / "p1.jsonl", "a") as f:
        f.write('{"client":"p1","op":"app')  # killed mid-line
    skipped: list[str] = []
    ops = load_history([tmp_path], skipped)
    assert [o["op"] for o in ops] == ["append", "ack"]
    assert len(skipped) == 1


def test_a_malformed_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text(
        '{"client":"a","op":"ack","id":1,"t":1}\nnot json\n{"client":"a","op":"ack","id":2,"t":2}\n'
    )
    with pytest.raises(ValueError, match="not a JSON object"):
        load_history([tmp_path / "x.jsonl"])


def test_command_line_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text("".join(json.dumps(o) + "\n" for o in clean().ops))
    h = clean()
    h.append("p3", 1, "a", [v("p3", 0)], offset=4)
    bad.write_text("".join(json.dumps(o) + "\n" for o in h.ops))
    assert main([str(good)]) == 0
    assert "history check: OK" in capsys.readouterr().out
    assert main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "lost-write 1" in out and "FAILED" in out
