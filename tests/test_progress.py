"""onceflow._progress: bars on a terminal, nothing anywhere else."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from onceflow._progress import progress_display


def test_not_a_terminal_gives_a_display_that_does_nothing() -> None:
    out = io.StringIO()
    with progress_display(console=Console(file=out, force_terminal=False)) as display:
        assert not display.active
        bar = display.task("work", 10, unit="items", text="{failed} failed", failed=0)
        bar.update(3, failed=1)
        bar.advance()
        display.log("a line")
    assert out.getvalue() == ""


def test_disabled_gives_a_display_that_does_nothing_even_on_a_terminal() -> None:
    out = io.StringIO()
    with progress_display(console=Console(file=out, force_terminal=True), enabled=False) as display:
        assert not display.active
        display.task("work", 10).update(5)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_with_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm")  # not a dumb one, whatever runs the tests
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    with progress_display(console=console) as display:
        assert display.active
        bar = display.task("onceflow sim", 10, unit="seeds", text="{failed} failed", failed=0)
        bar.update(7, failed=2)
        display.log("a line above the bar")
    text = out.getvalue()
    assert "onceflow sim" in text and "7/10" in text and "seeds" in text and "2 failed" in text, text
    assert "seeds/s" in text and "a line above the bar" in text, text


def test_a_bench_reports_plain_lines_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from onceflow_tools.bench.progress import bench_progress, say

    with bench_progress("txn", console=Console(file=io.StringIO(), force_terminal=False)) as display:
        assert not display.active
        say("onceflow serve ready")
        say("p99 4.2 ms", prefix="[bench spark]")
    assert capsys.readouterr().out == "[bench] onceflow serve ready\n[bench spark] p99 4.2 ms\n"


def test_a_bench_on_a_terminal_counts_its_steps_and_prints_each_above_the_bar(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from onceflow_tools.bench.progress import bench_progress, say

    monkeypatch.setenv("TERM", "xterm")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    with bench_progress("compare", console=console) as display:
        assert display.active
        say("redis: 61,094 appends/s")
        say("onceflow: 15,120 appends/s")
    shown = out.getvalue()
    last = shown.rsplit("\r", 1)[-1]  # the bar as it was left: two steps, the latest as its text
    assert "onceflow bench compare" in last and "2/? steps" in last and "onceflow: 15,120 appends/s" in last
    assert "[bench] redis: 61,094 appends/s" in shown and "[bench] onceflow: 15,120 appends/s" in shown
    assert capsys.readouterr().out == ""  # nothing printed beside the display
    say("after the bench")  # the display is gone: a plain line again
    assert capsys.readouterr().out == "[bench] after the bench\n"


def test_a_bench_step_that_looks_like_markup_is_shown_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    from onceflow_tools.bench.progress import bench_progress, say

    monkeypatch.setenv("TERM", "xterm")
    out = io.StringIO()
    with bench_progress("txn", console=Console(file=out, force_terminal=True, width=120, color_system=None)):
        say("wrk [/usr/bin/wrk] not found, [bold]python[/bold] generator")
    assert "[/usr/bin/wrk]" in out.getvalue().rsplit("\r", 1)[-1]
