"""JSON-mode framing: validate an append, flatten one array level, store compact texts."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from ..errors import OnceflowError

__all__ = ["JsonError", "encode_messages", "first_messages", "parse_control", "wrap_payloads"]

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


class JsonError(OnceflowError, ValueError):
    """The body is not acceptable JSON for this operation; the message says why."""


def _reject_constant(name: str) -> Any:
    raise JsonError(f"{name} is not valid JSON")


# Built once: passing parse_constant to json.loads would build a new decoder on every call.
_decode = json.JSONDecoder(parse_constant=_reject_constant).decode

# A body with no whitespace outside its strings is already compact: it can be stored as sent
# (after validation) instead of being encoded again, which halves the cost of a JSON append.
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_WHITESPACE = re.compile(rb"[ \t\n\r]")
_STRINGS_KEPT = re.compile(b"(" + _STRINGS.pattern + b")")  # split() keeps what a group matched


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_control(raw: bytes) -> Any:
    """The JSON of a control request's body (a transaction's init, a group's offsets, a
    subscription, a guard's look at either): its strings become names and ids, so they must be
    Unicode text. JSON can spell a lone UTF-16 surrogate (``"\\ud800"``) and text cannot: such a body
    is refused here (:class:`JsonError`, a ``ValueError``, as for any JSON the json module refuses),
    not wherever one of its strings is first encoded."""
    value = json.loads(raw)
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then is every string looked at
        where = _not_text(value, "")
        if where is not None:
            raise JsonError(
                f"{where or 'the body'} holds a lone UTF-16 surrogate (\\ud800 to \\udfff unpaired): not text"
            )
    return value


def _not_text(value: Any, at: str) -> str | None:
    """Where in ``value`` (``at``: its place, e.g. ``"group"`` or ``"offsets" key``) the first
    string that is not text is, or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return at
        return None
    items: Any = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        place = f"{at}[{k!r}]" if at else repr(k)
        if isinstance(k, str) and _not_text(k, "") is not None:
            return f"a key of {at or 'the body'}"
        found = _not_text(v, place)
        if found is not None:
            return found
    return None


def _is_compact(body: bytes) -> bool:
    if not (b" " in body or b"\n" in body or b"\t" in body or b"\r" in body):
        return True  # no whitespace anywhere: four byte scans, far cheaper than taking the strings out
    return _WHITESPACE.search(_STRINGS.sub(b"", body)) is None


def _strip_whitespace(body: bytes) -> bytes:
    """``body`` (valid JSON) without the whitespace outside its strings: the same text, compact."""
    parts = _STRINGS_KEPT.split(body)  # [outside, string, outside, string, ..., outside]
    parts[::2] = [p.translate(None, b" \t\n\r") for p in parts[::2]]
    return b"".join(parts)


# The fast path: msgspec checks the JSON and finds an array's elements in C without building them
# (~0.1 us per 100-byte message, against ~0.9 us for json.loads). It accepts nothing the json
# module rejects (tests/core/test_jsonmode.py compares them) but rejects a few texts json takes
# (lone surrogate escapes); whatever it refuses goes to the json module, which decides as before.
_split_array = msgspec.json.Decoder(list[msgspec.Raw]).decode
_check_value = msgspec.json.Decoder(msgspec.Raw).decode
_compact = msgspec.json.format


def encode_messages(body: bytes, *, allow_empty: bool) -> tuple[bytes, int]:
    """Stored payload and message count for a JSON body.

    A top-level array is flattened one level (each element is a message); any other value is one
    message. ``[]`` is an error for appends and an empty stream for creates (``allow_empty``).
    Every value the json module accepts is stored (numbers out of float range and lone surrogate
    escapes included, as their text); nesting deeper than the decoder's recursion limit is a
    JsonError. A body with whitespace outside its strings is stored without it. Only JsonError is
    raised.
    """
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"body is not UTF-8: {exc}") from None
    array = body.lstrip(b" \t\n\r")[:1] == b"["
    try:
        count = len(_split_array(body)) if array else 1
        if not array:
            _check_value(body)
    except (msgspec.DecodeError, RecursionError):
        return _encode_slowly(body, allow_empty)
    if not _is_compact(body):
        body = _compact(body, indent=-1)
    if not array:
        return body + b",", 1
    if not count:
        if allow_empty:
            return b"", 0
        raise JsonError("an empty JSON array appends nothing; send at least one message")
    return b"".join((memoryview(body)[1:-1], b",")), count  # one copy of a large body, not two


def _encode_slowly(body: bytes, allow_empty: bool) -> tuple[bytes, int]:
    """:func:`encode_messages` by the json module: for what msgspec refused (an error, or a text
    only json takes); the error messages are json's."""
    text = body.decode("utf-8")
    try:
        value = _decode(text)
    except JsonError:
        raise
    except ValueError as exc:
        raise JsonError(f"invalid JSON: {exc}") from None
    except RecursionError:
        raise JsonError("invalid JSON: nested too deeply") from None
    if not _is_compact(body):
        try:
            # one encoder call for the whole value (for an array, "[a,b]" -> "a,b,": the same
            # bytes as encoding each element)
            body = _dumps(value).encode()
        except (ValueError, UnicodeEncodeError, RecursionError):
            body = _strip_whitespace(body)  # 1e400, "\ud800": no encoding of the value, keep the text
    if not isinstance(value, list):
        return body + b",", 1
    if not value:
        if allow_empty:
            return b"", 0
        raise JsonError("an empty JSON array appends nothing; send at least one message")
    return body[1:-1] + b",", len(value)


def wrap_payloads(payloads: list[bytes]) -> bytes:
    """Join stored JSON payloads into one JSON array."""
    joined = b"".join(payloads)
    if not joined:
        return b"[]"
    return b"[" + joined[:-1] + b"]"


# What matters when cutting stored messages apart: strings (skipped whole), brackets and commas.
_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]|,')


def first_messages(payload: bytes, n: int) -> bytes:
    """The first ``n`` message texts of a stored JSON payload, each followed by its comma, as stored.

    A stored payload is compact JSON texts each followed by a comma (:func:`encode_messages`). It
    is cut at the commas outside strings and brackets, without decoding or encoding anything, so
    whatever an append stored comes back byte for byte however deep or odd it is. Raises JsonError
    when the payload holds fewer than ``n`` messages.
    """
    if n <= 0:
        return b""
    depth = 0
    for m in _STRUCTURE.finditer(payload):
        c = payload[m.start()]
        if c == 0x22:  # '"'
            continue
        if c in (0x5B, 0x7B):  # '[', '{'
            depth += 1
        elif c in (0x5D, 0x7D):  # ']', '}'
            depth -= 1
        elif depth == 0:  # a comma between messages
            n -= 1
            if n == 0:
                return payload[: m.end()]
    raise JsonError("the payload holds fewer messages than asked for")
