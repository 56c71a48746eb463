"""The Spark source's split of stored JSON payloads into rows (no Spark session needed): msgspec's
fast split gives the texts the json module's slow one gives, for text and binary values."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.core.jsonmode import encode_messages
from onceflow.spark.source import split_json, split_json_bytes

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
