"""The pause before a retry (onceflow._backoff), shared by every client-side retry loop."""

from __future__ import annotations

import random

from onceflow._backoff import DEFAULT, backoff


def test_pauses_double_from_low_up_to_high_within_a_fifth() -> None:
    low, high = DEFAULT
    for attempt in range(1, 80):
        middle = min(high, low * 2**attempt)
        assert 0.8 * middle <= backoff(attempt) <= 1.2 * middle
    assert max(backoff(a, 0.01, 0.3) for a in range(1, 200)) <= 0.36  # a late attempt stays at high


def test_a_seeded_random_gives_the_same_pauses() -> None:
    a = [backoff(n, 0.1, 5.0, rng=random.Random(7)) for n in range(1, 10)]
    b = [backoff(n, 0.1, 5.0, rng=random.Random(7)) for n in range(1, 10)]
    assert a == b
    assert len({round(p / min(5.0, 0.1 * 2**n), 6) for n, p in enumerate(a, 1)}) == 1  # one draw each, same seed
