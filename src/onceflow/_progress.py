"""Progress bars for long commands (``onceflow demo``, ``sim``, ``chaos``, ``bench``): a ``rich`` display on stderr
when stderr is a terminal, nothing at all otherwise (CI logs, soaks, pipes stay clean).

``rich`` is imported only when a display is opened, so that importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

__all__ = ["Display", "Task", "progress_display"]


class Task:
    """One bar of a display; every method does nothing when the display is off."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress, self._task = progress, task

    def update(self, completed: float | None = None, *, total: float | None = None, **fields: Any) -> None:
        """Set how much is done (and the total, and the fields the bar's text names)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=completed, total=total, **fields)

    def advance(self, amount: float = 1) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, amount)


class Display:
    """Bars on a terminal (``active``), or nothing."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress

    @property
    def active(self) -> bool:
        return self._progress is not None

    def task(
        self, description: str, total: float | None, *, unit: str = "", rate: bool = True, text: str = "", **fields: Any
    ) -> Task:
        """A bar: ``description``, done/total ``unit``, the rate in ``unit``/s (if ``rate``), ``text`` (a ``str.format``
        template of ``fields``, set again with ``Task.update``), the time left."""
        if self._progress is None:
            return Task(None, None)
        task = self._progress.add_task(description, total=total, unit=unit, rate=rate, text=text.format(**fields))
        return _Templated(self._progress, task, text, fields)

    def log(self, message: str) -> None:
        """A line above the bars (only when active: callers print their own lines otherwise)."""
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)


class _Templated(Task):
    def __init__(self, progress: Progress, task: TaskID, text: str, fields: dict[str, Any]) -> None:
        super().__init__(progress, task)
        self._text, self._fields = text, dict(fields)

    def update(self, completed: float | None = None, *, total: float | None = None, **fields: Any) -> None:
        self._fields.update(fields)
        super().update(completed, total=total, text=self._text.format(**self._fields))


@contextmanager
def progress_display(*, console: Console | None = None, enabled: bool = True) -> Iterator[Display]:
    """A display on ``console`` (by default stderr) when ``enabled`` and the console is a terminal
    that can redraw a line; an inactive one (whose bars do nothing) otherwise."""
    if not enabled:
        yield Display(None)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = console if console is not None else Console(stderr=True)
    if not console.is_terminal or console.is_dumb_terminal:
        yield Display(None)
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        _rate_column(),
        TextColumn("{task.fields[text]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    with progress:
        yield Display(progress)


def _rate_column() -> Any:
    """A column of the mean done per second, in the task's unit (defined here: ``rich`` is imported lazily)."""
    from rich.progress import ProgressColumn
    from rich.progress import Task as RichTask
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: RichTask) -> Text:
            elapsed = task.elapsed  # the mean since the start: steadier than rich's recent samples
            unit = task.fields.get("unit") or "done"
            if not (task.fields.get("rate", True) and elapsed and task.completed):
                return Text("")
            return Text(f"{task.completed / elapsed:,.1f} {unit}/s", style="progress.data.speed")

    return RateColumn()
