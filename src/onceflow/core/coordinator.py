"""The transaction coordinator: transactional ids and their transactions, consumer groups' offsets
and sinks' batches, persisted in one coordinator log (docs/transactions.md). Built in layers, each
a module: the log, the meaning of its records and transactions (core/txn.py), groups' offsets
(core/groups.py), many transactions committed as one (core/batches.py)."""

from __future__ import annotations

from .batches import Batches

__all__ = ["Coordinator"]


class Coordinator(Batches):
    """Transactions and group offsets, persisted in one coordinator log."""
