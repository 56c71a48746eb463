"""Positions in a stream's log and the opaque offset tokens clients see."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Position", "parse_token"]

_TOKEN = re.compile(r"(\d{16})_(\d{16})")


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """A boundary between batches: the next record offset and the byte position of the log there.

    Both grow together, so ordering by ``offset`` and by ``pos`` agree. The token is the two numbers
    zero-padded to 16 digits, which keeps tokens of one stream lexicographically sortable as the
    protocol requires, and lets a read seek straight to the byte position without an index.
    """

    offset: int
    pos: int

    def token(self) -> str:
        return f"{self.offset:016d}_{self.pos:016d}"


ZERO = Position(0, 0)


def parse_token(token: str) -> Position | None:
    """The Position a token names, or None when it is not a well-formed token."""
    m = _TOKEN.fullmatch(token)
    if m is None:
        return None
    return Position(int(m.group(1)), int(m.group(2)))
