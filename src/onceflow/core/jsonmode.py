"""JSON-mode framing: validate an append, flatten one array level, store compact texts."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["JsonError", "encode_messages", "wrap_payloads"]

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


class JsonError(ValueError):
    """The body is not acceptable JSON for this operation; the message says why."""


def _reject_constant(name: str) -> Any:
    raise JsonError(f"{name} is not valid JSON")


# Built once: passing parse_constant to json.loads would build a new decoder on every call.
_decode = json.JSONDecoder(parse_constant=_reject_constant).decode

# A body with no whitespace outside its strings is already compact: it can be stored as sent
# (after validation) instead of being encoded again, which halves the cost of a JSON append.
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_WHITESPACE = re.compile(rb"[ \t\n\r]")


def _is_compact(body: bytes) -> bool:
    if not (b" " in body or b"\n" in body or b"\t" in body or b"\r" in body):
        return True  # no whitespace anywhere: four byte scans, far cheaper than taking the strings out
    return _WHITESPACE.search(_STRINGS.sub(b"", body)) is None


def encode_messages(body: bytes, *, allow_empty: bool) -> tuple[bytes, int]:
    """Stored payload and message count for a JSON body.

    A top-level array is flattened one level (each element is a message); any other value is one
    message. ``[]`` is an error for appends and an empty stream for creates (``allow_empty``).
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"body is not UTF-8: {exc}") from None
    try:
        return _encode(body, _decode(text), allow_empty=allow_empty)
    except JsonError:
        raise
    except ValueError as exc:
        raise JsonError(f"invalid JSON: {exc}") from None
    except RecursionError:  # decoding or re-encoding: either recurses once per level
        raise JsonError("the JSON is nested too deeply") from None


def _encode(body: bytes, value: Any, *, allow_empty: bool) -> tuple[bytes, int]:
    compact = _is_compact(body)
    if not isinstance(value, list):
        return (body if compact else _dumps(value).encode()) + b",", 1
    items = value
    if not items:
        if allow_empty:
            return b"", 0
        raise JsonError("an empty JSON array appends nothing; send at least one message")
    if compact:
        return body[1:-1] + b",", len(items)
    # one encoder call for the whole array, then "[a,b]" -> "a,b,": the same bytes as encoding each
    return (_dumps(items)[1:-1] + ",").encode(), len(items)


def wrap_payloads(payloads: list[bytes]) -> bytes:
    """Join stored JSON payloads into one JSON array."""
    joined = b"".join(payloads)
    if not joined:
        return b"[]"
    return b"[" + joined[:-1] + b"]"


def split_messages(payload: bytes) -> list[bytes]:
    """The individual message texts of one stored JSON payload."""
    if not payload:
        return []
    return [_dumps(v).encode() for v in json.loads(b"[" + payload[:-1] + b"]")]
