"""JSON-mode framing: the msgspec fast path decides exactly as the json module does.

``encode_messages`` checks and splits with msgspec and hands whatever msgspec refuses to the json
module (``_encode_slowly``), which was the only path before. These tests hold the two to the same
answers: the same texts accepted, the same messages stored (as values), the same count."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.core.jsonmode import JsonError, _encode_slowly, encode_messages, wrap_payloads

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def outcome(encode: Any, body: bytes) -> tuple[str, Any]:
    try:
        payload, count = encode(body, allow_empty=True)
    except JsonError:
        return "refused", None
    return "stored", (count, json.loads(wrap_payloads([payload])))


@settings(max_examples=400, deadline=None)
@given(values, st.sampled_from([None, 0, 2]), st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))
def test_every_json_text_is_stored_as_the_json_module_stores_it(value: Any, indent: Any, seps: Any) -> None:
    body = json.dumps(value, indent=indent, separators=seps, ensure_ascii=False).encode()
    fast, slow = outcome(encode_messages, body), outcome(_encode_slowly, body)
    assert fast == slow
    count, stored = fast[1]
    if isinstance(value, list):
        assert count == len(value) and stored == value
    else:
        assert count == 1 and stored == [value]


def test_texts_near_json_are_refused_exactly_when_the_json_module_refuses_them() -> None:
    alphabet = b'[]{}",:0123456789.-+eE truefalsn\\u\t\n\x01'
    rng = random.Random(7)
    for _ in range(20_000):
        body = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert outcome(encode_messages, body)[0] == outcome(_encode_slowly, body)[0], body


@pytest.mark.parametrize(
    ("body", "stored"),
    [
        (b'["\\ud800"]', b'"\\ud800",'),  # a lone surrogate: msgspec refuses it, json takes it, as before
        (b"[1e400]", b"1e400,"),  # out of float range: kept as its text
        (b'[ {"a" : 1} , "x y" ]', b'{"a":1},"x y",'),  # whitespace outside strings goes
        (b'{"k": [1, 2]}', b'{"k":[1,2]},'),  # a single value, compacted
    ],
)
def test_odd_but_valid_texts_are_stored(body: bytes, stored: bytes) -> None:
    assert encode_messages(body, allow_empty=False)[0] == stored


def test_what_is_refused_says_why() -> None:
    for body, why in (
        (b"[]", "empty JSON array"),
        (b"[1,]", "invalid JSON"),
        (b"\xff", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"[NaN]", "not valid JSON"),
    ):
        with pytest.raises(JsonError, match=why):
            encode_messages(body, allow_empty=False)
