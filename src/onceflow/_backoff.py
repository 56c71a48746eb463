"""The pause before a retry, for the client side's retry loops (the idempotent and transactional
producers, the Spark connector's calls, the outbox sink): ``low`` doubled at each attempt, at most
``high``, each pause drawn within ±20 % of that so that many clients failed by one outage do not
all come back at the same moment."""

from __future__ import annotations

import random
from typing import Protocol

__all__ = ["DEFAULT", "backoff"]

DEFAULT = (0.05, 2.0)  # (low, high) seconds: what every retry loop of onceflow uses unless told


class _Random(Protocol):
    def random(self) -> float: ...


def backoff(attempt: int, low: float = DEFAULT[0], high: float = DEFAULT[1], *, rng: _Random = random) -> float:
    """Seconds to wait before retry number ``attempt`` (1 for the first): ``low * 2**attempt``, at
    most ``high``, times a factor between 0.8 and 1.2. ``rng``: where the factor comes from (a
    seeded :class:`random.Random` in a simulation; the ``random`` module otherwise)."""
    return min(high, low * 2.0 ** min(attempt, 60)) * (0.8 + 0.4 * rng.random())  # noqa: S311
