"""A bench's progress on a terminal: one bar that counts the steps it reports (a server started, a
measurement begun, a figure measured), with the latest step as its text, and each step printed
above it as it comes, a live summary of what was measured so far. Off a terminal (logs, CI) the
steps are the plain ``[bench] ...`` lines they always were.

Steps are reported with :func:`say` (``append._say`` and the Spark bench's go through it); the
bench commands run inside :func:`bench_progress` (``bench/cli.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

from onceflow._progress import Display, Task, progress_display

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["bench_progress", "say"]


class _Current:
    display: Display | None = None
    bar: Task | None = None
    steps = 0


_now = _Current()


@contextmanager
def bench_progress(name: str, *, console: Console | None = None) -> Iterator[Display]:
    """The display of ``onceflow bench NAME`` for the duration of the block (inactive off a terminal)."""
    with progress_display(console=console) as display:
        if display.active:
            _now.display, _now.steps = display, 0
            _now.bar = display.task(f"onceflow bench {name}", None, unit="steps", rate=False, text="{step}", step="")
        try:
            yield display
        finally:
            _now.display = _now.bar = None


def say(text: str, *, prefix: str = "[bench]", stream: TextIO | None = None) -> None:
    """Report a step: above the bar on a terminal, else a plain line on ``stream`` (stdout)."""
    if _now.display is None or _now.bar is None:
        print(f"{prefix} {text}", file=stream or sys.stdout, flush=True)
        return
    from rich.markup import escape  # the bar's text is markup: a step is shown as written

    _now.display.log(f"{prefix} {text}")
    _now.steps += 1
    step = text.strip()
    _now.bar.update(_now.steps, step=escape(step if len(step) <= 60 else step[:59] + "…"))
