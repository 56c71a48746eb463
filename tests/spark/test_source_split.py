"""The Spark source's split of stored JSON payloads into rows (no Spark session needed): msgspec's
fast split gives the texts the json module's slow one gives, for text and binary values."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.core.jsonmode import encode_messages
from onceflow.spark.source import Frame, frames_to_arrow, split_json, split_json_bytes

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(values, min_size=1, max_size=8))
def test_rows_are_the_stored_messages_in_order(messages: list[Any]) -> None:
    payload, count = encode_messages(json.dumps(messages, ensure_ascii=False).encode(), allow_empty=False)
    texts = split_json(payload)
    assert len(texts) == count and [json.loads(t) for t in texts] == messages
    assert split_json_bytes(payload) == [t.encode() for t in texts]


def test_a_payload_msgspec_refuses_is_split_by_the_json_module() -> None:
    payload, _ = encode_messages(b'["\\ud800", {"a": 1}]', allow_empty=False)  # stored as sent
    assert split_json(payload) == ['"\\ud800"', '{"a":1}']
    assert split_json_bytes(payload) == [b'"\\ud800"', b'{"a":1}']
    assert split_json(b"") == [] and split_json_bytes(b"") == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(values, min_size=1, max_size=5), min_size=1, max_size=4))
def test_a_record_batch_holds_each_message_as_a_row(appends: list[list[Any]]) -> None:
    """The rows Spark gets: text values as the stored texts (non-ASCII, escapes), binary values as their
    UTF-8, offsets counting messages, the stream and content type on every row."""
    frames, offset, expected = [], 7, []
    for i, messages in enumerate(appends):
        payload, count = encode_messages(json.dumps(messages, ensure_ascii=False).encode(), allow_empty=False)
        frames.append(Frame(base_offset=offset, count=count, timestamp_ms=1_000 + i, payload=payload))
        expected += [(offset + k, (1_000 + i) * 1000, t) for k, t in enumerate(split_json(payload))]
        offset += count
    batch = frames_to_arrow("s/é", "application/json", frames, True)
    text = batch.to_pydict()
    binary = frames_to_arrow("s/é", "application/json", frames, False).to_pydict()
    assert text["value"] == [t for _, _, t in expected]
    assert binary["value"] == [t.encode() for _, _, t in expected]
    assert text["offset"] == binary["offset"] == [o for o, _, _ in expected]
    assert batch.column("timestamp").cast(pa.int64()).to_pylist() == [us for _, us, _ in expected]
    assert set(text["stream"]) == {"s/é"} and set(text["content_type"]) == {"application/json"}
    assert len(text["stream"]) == len(text["content_type"]) == len(expected)


def test_the_sink_takes_each_row_value_as_its_utf8_bytes() -> None:
    """The sink's rows from an Arrow batch (no Spark needed): string, large string and binary values
    give the same bytes, per target stream; a null value or target is refused."""
    from onceflow.spark.options import Options
    from onceflow.spark.writer import _rows

    texts = ['{"a":"é"}', '"\\ud800"', "[1,2]"]
    one = Options.parse({"url": "http://127.0.0.1:1", "stream": "out"})
    for column in (pa.array(texts), pa.array(texts, pa.large_string()), pa.array([t.encode() for t in texts])):
        assert _rows(pa.RecordBatch.from_arrays([column], names=["value"]), one) == {"out": [t.encode() for t in texts]}
    per_row = pa.RecordBatch.from_arrays([pa.array(texts), pa.array(["x", "y", "x"])], names=["value", "stream"])
    assert _rows(per_row, one) == {"x": [texts[0].encode(), texts[2].encode()], "y": [texts[1].encode()]}
    for bad in (
        pa.RecordBatch.from_arrays([pa.array(["1", None])], names=["value"]),
        pa.RecordBatch.from_arrays([pa.array(["1", "2"]), pa.array(["x", None])], names=["value", "stream"]),
    ):
        with pytest.raises(ValueError, match="null"):
            _rows(bad, one)


def test_a_payload_not_laid_out_as_stored_is_still_split_text_by_text() -> None:
    """Whitespace after a comma (no server writes it, but a payload is data from disk) and a text
    msgspec refuses: the rows are the texts all the same, each at its offset."""
    frames = [
        Frame(base_offset=3, count=2, timestamp_ms=5, payload=b'{"a":1}, {"b":[2, 3]},'),
        Frame(base_offset=5, count=2, timestamp_ms=6, payload=b'"\\ud800",{"c":"\xc3\xa9"},'),
    ]
    batch = frames_to_arrow("s", "application/json", frames, True).to_pydict()
    assert batch["value"] == ['{"a":1}', '{"b":[2, 3]}', '"\\ud800"', '{"c":"é"}']
    assert batch["offset"] == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="holds 2 messages, header says 3"):
        frames_to_arrow("s", "application/json", [Frame(0, 3, 0, b"1,2,")], True)


def test_a_frame_whose_lengths_add_up_only_across_frames_is_split_text_by_text() -> None:
    """The fast column takes each text at the offset its length gives; when a frame's separators
    are not single commas, a short frame can make up for a long one (or a multi-byte separator for
    a missing comma) so that the total fits while the offsets do not: the rows must still be the
    texts the json module finds, never a neighbour's bytes (found by review)."""
    cases = [
        [Frame(0, 2, 1, b"1\xc3\xa92")],
        [Frame(0, 2, 1, b"1,2"), Frame(2, 1, 1, b"3 ,")],
    ]
    for frames in cases:
        texts = [t for f in frames for t in split_json_bytes(f.payload)]
        assert frames_to_arrow("s", "application/json", frames, False).to_pydict()["value"] == texts


def test_byte_streams_give_a_row_per_append() -> None:
    frames = [Frame(base_offset=10, count=1, timestamp_ms=1, payload=b"\x00\xff"), Frame(11, 1, 2, b"ok")]
    assert frames_to_arrow("b", "application/octet-stream", frames, False).to_pydict()["value"] == [b"\x00\xff", b"ok"]
    text = frames_to_arrow("t", "text/plain", frames, True).to_pydict()
    assert text["value"] == ["\x00\ufffd", "ok"] and text["offset"] == [10, 11]
    assert frames_to_arrow("t", "application/json", [], True).num_rows == 0
