"""How much state a client can make the server hold (issue 28, "Bounded by design"): a module of
its own, without the core's imports, so that the command line reads the defaults cheaply."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StateLimits"]


@dataclass(frozen=True, slots=True)
class StateLimits:
    """How many groups, transactional ids, sinks and subscriptions the server holds at most,
    server-wide (``onceflow serve --max-groups``, ``--max-transactional-ids``, ``--max-sinks``,
    ``--max-subscriptions``; a guard's ``limits`` may set lower ones). Past one, creating another
    is refused (``limit``, a 429); what exists goes on working, and deleting one makes room."""

    groups: int = 100_000
    transactional_ids: int = 100_000  # sinks' tasks' ids (spark/<sink>/p<n>/s<m>) included
    sinks: int = 10_000
    subscriptions: int = 10_000
