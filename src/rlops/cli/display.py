"""What every ``rlops`` subcommand prints with: number formats, tables and a progress bar.

Rich draws the tables, and the bar on a terminal, when it is installed (the ``bench`` extra);
without it the tables are aligned plain text. Off a terminal (or without rich) the bar is a
line per step (every tenth of a long run). While the bar is on screen, everything printed goes
through its console, above it. Everything printed is flushed at once, so a pipe or a log file
sees each table as soon as it is complete. Long lines are wrapped between words to a
terminal's width (a terminal would cut them anywhere, inside a number).
"""

from __future__ import annotations

import shutil
import sys
import textwrap
import time

__all__ = ["Progress", "fmt_mib", "fmt_ms", "fmt_s", "json_config", "print_table", "say", "wrap"]

WIDE = 110  # columns for tables written to a file or a pipe (no terminal to wrap at)


def fmt_ms(seconds: float) -> str:
    """Milliseconds, without the unit: three decimals below 10 ms, one above
    (``0.929``, ``3,089.2``)."""
    ms = seconds * 1e3
    return f"{ms:,.3f}" if ms < 10 else f"{ms:,.1f}"


def fmt_mib(n_bytes: int | float | None) -> str:
    """Mebibytes with one decimal, without the unit; ``n/a`` where nothing was measured."""
    return "n/a" if n_bytes is None else f"{n_bytes / 2**20:,.1f}"


def fmt_s(seconds: float) -> str:
    """A duration as ``m:ss``."""
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def wrap(line: str, width: int | None = None, indent: str = "  ") -> list[str]:
    """``line`` broken between words to ``width`` columns (default: the terminal's, and not at
    all off a terminal), continuation lines indented."""
    if width is None:
        if not sys.stdout.isatty():
            return [line]
        width = shutil.get_terminal_size().columns
    return textwrap.wrap(
        line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    ) or [line]


_live = None  # the rich progress bar on screen, if any: print through its console


def say(*lines: str) -> None:
    """Print lines and flush (stdout is block-buffered when it is not a terminal)."""
    for line in lines:
        if _live is not None:
            _live.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line)
    sys.stdout.flush()


def json_config(args) -> dict:
    """The options of a run as its JSON record states them (output paths left out)."""
    return {k: v for k, v in vars(args).items() if k not in ("json", "plot")}


def _new_console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, WIDE)
    return console


def _console():
    """The bar's console while it is on screen (a second console writing to the terminal
    would print onto the bar's line), else a new one."""
    return _new_console() if _live is None else _live.console


def print_table(
    title: str,
    header: list[str],
    rows: list[list[str]],
    *,
    caption: str | None = None,
    total_row: bool = False,
) -> None:
    """One table: first column left-aligned, the others right-aligned; ``total_row``: the last
    row is set apart (a rule above it)."""
    try:
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [title]
        for k, r in enumerate([header, *rows]):
            if total_row and k == len(rows):
                lines.append("  ".join("-" * w for w in widths))
            lines.append(
                "  ".join(
                    c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
                )
            )
        say(*lines, *([caption] if caption else []))
        return
    table = Table(title=title, caption=caption)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for i, r in enumerate(rows):
        table.add_row(*r, end_section=total_row and i == len(rows) - 2)
    _console().print(table)
    sys.stdout.flush()


class Progress:
    """A progress bar over steps: ``label``, bar, ``done/total``, elapsed time, an estimate of
    the time left, the step running now and a short status text. Without rich or off a
    terminal: a plain line per step (every tenth of the run past 20 steps).

    ``steps``: a count, or the ``(name, weight)`` of each step in order, ``weight`` its
    expected share of the time: the time left is estimated as the elapsed time times the weight
    left over the weight done. ``keep``: leave the finished bar on screen (else it vanishes
    when done). Use as a context manager; call :meth:`update` after each step.
    """

    def __init__(self, steps, label: str = "measuring", *, keep: bool = False):
        self.steps = [("", 1.0)] * steps if isinstance(steps, int) else list(steps)
        self.total, self.label, self.done = len(self.steps), label, 0
        self._start = time.perf_counter()
        self._bar = None
        try:
            from rich import progress as rp
        except ImportError:
            return
        console = _console()
        if not console.is_terminal:
            return
        self._bar = rp.Progress(
            rp.TextColumn(label),
            rp.BarColumn(),
            rp.MofNCompleteColumn(),
            rp.TimeElapsedColumn(),
            rp.TextColumn("{task.description}"),
            transient=not keep,
            console=console,
        )
        self._task = self._bar.add_task(self.status(), total=self.total)

    def left(self, elapsed: float | None = None) -> float | None:
        """Estimated seconds left (``elapsed``: seconds so far, default: measured now); None
        before the first step is done."""
        done = sum(w for _, w in self.steps[: self.done])
        if done <= 0:
            return None
        elapsed = time.perf_counter() - self._start if elapsed is None else elapsed
        return elapsed * sum(w for _, w in self.steps[self.done :]) / done

    def status(self, text: str = "", elapsed: float | None = None) -> str:
        """What the line shows beside the bar: time left, the step running now, ``text``."""
        left = self.left(elapsed) if self.done < self.total else None
        now = self.steps[self.done][0] if self.done < self.total else ""
        return "  ".join(p for p in (left and f"~{fmt_s(left)} left", now, text) if p)

    def __enter__(self) -> Progress:
        global _live
        self._start = time.perf_counter()
        if self._bar is not None:
            self._bar.start()
            _live = self._bar
        elif self.steps and self.steps[0][0]:
            say(f"{self.label} 0/{self.total}: {self.status()}")
        return self

    def update(self, text: str = "") -> None:
        """One more step done; ``text``: a status to show beside the bar."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=self.status(text))
            return
        every = max(1, self.total // 10) if self.total > 20 else 1
        if self.done % every == 0 or self.done == self.total:
            elapsed = time.perf_counter() - self._start
            status = self.status(text, elapsed)
            line = f"{self.label} {self.done}/{self.total} ({fmt_s(elapsed)})"
            say(line + (f": {status}" if status else ""))

    def __exit__(self, *exc) -> None:
        global _live
        if self._bar is not None:
            self._bar.stop()
            _live = None
