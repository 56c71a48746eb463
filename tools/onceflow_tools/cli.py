"""The sub-commands ``onceflow bench``, ``onceflow chaos`` and ``onceflow sim`` (onceflow's CLI calls
:func:`add_parsers` when onceflow_tools is installed)."""

from __future__ import annotations

from typing import Any

__all__ = ["COMMANDS", "add_parsers"]

COMMANDS = ("bench", "chaos", "sim")


def add_parsers(sub: Any) -> None:
    """Add the tools' sub-commands to onceflow's ``argparse`` sub-parsers."""
    from .bench.cli import add_bench_parser
    from .chaos.run import add_chaos_parser
    from .sim.cli import add_sim_parser

    add_bench_parser(sub)
    add_chaos_parser(sub)
    add_sim_parser(sub)
