"""Chaos testing: ``onceflow chaos`` (:mod:`.run`), its client processes (:mod:`.worker`) and the
history checker (:mod:`.history`, also ``python -m onceflow_tools.chaos.history DIR``).

Nothing is imported here, so that ``python -m onceflow_tools.chaos.history`` runs the module once.
"""

__all__: list[str] = []
