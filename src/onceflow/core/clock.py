"""The clocks the broker and the coordinator read, as an object that can be replaced.

The server uses :data:`SYSTEM`; the deterministic simulator substitutes simulated time, so that
transaction timeouts, stream TTLs and batch timestamps follow the simulation, not the machine.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM", "Clock", "SystemClock"]


class Clock(Protocol):
    def time(self) -> float: ...  # wall-clock seconds since the epoch
    def monotonic(self) -> float: ...  # seconds, never going backwards


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM: Clock = SystemClock()
