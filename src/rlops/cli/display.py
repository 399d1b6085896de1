"""What every ``rlops`` subcommand prints with: number formats, tables and a progress bar.

Rich draws the tables, and the bar on a terminal, when it is installed (the ``bench`` extra);
without it the tables are aligned plain text. Off a terminal (or without rich) the bar is a
line every tenth of the run. Everything printed is flushed at once, so a pipe or a log file
sees each table as soon as it is complete.
"""

from __future__ import annotations

import sys

__all__ = ["Progress", "fmt_mib", "fmt_ms", "print_table", "say"]

WIDE = 110  # columns for tables written to a file or a pipe (no terminal to wrap at)


def fmt_ms(seconds: float) -> str:
    """Milliseconds, without the unit: three decimals below 10 ms, one above
    (``0.929``, ``3,089.2``)."""
    ms = seconds * 1e3
    return f"{ms:,.3f}" if ms < 10 else f"{ms:,.1f}"


def fmt_mib(n_bytes: int | float | None) -> str:
    """Mebibytes with one decimal, without the unit; ``n/a`` where nothing was measured."""
    return "n/a" if n_bytes is None else f"{n_bytes / 2**20:,.1f}"


def say(*lines: str) -> None:
    """Print lines and flush (stdout is block-buffered when it is not a terminal)."""
    for line in lines:
        print(line)
    sys.stdout.flush()


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, WIDE)
    return console


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
    """A progress bar over ``total`` steps: ``label``, bar, ``done/total``, elapsed time and a
    short status text. Without rich or off a terminal: a plain line every tenth of the run.

    ``keep``: leave the finished bar on screen (else it vanishes when done). Use as a context
    manager; call :meth:`update` after each step.
    """

    def __init__(self, total: int, label: str = "measuring", *, keep: bool = False):
        self.total, self.label, self.done = total, label, 0
        self._bar = None
        try:
            from rich import progress as rp
            from rich.console import Console
        except ImportError:
            return
        if not Console().is_terminal:
            return
        self._bar = rp.Progress(
            rp.TextColumn(label),
            rp.BarColumn(),
            rp.MofNCompleteColumn(),
            rp.TimeElapsedColumn(),
            rp.TextColumn("{task.description}"),
            transient=not keep,
        )
        self._task = self._bar.add_task("", total=total)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def update(self, text: str = "") -> None:
        """One more step done; ``text``: a status to show beside the bar."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=text)
            return
        every = max(1, self.total // 10)
        if self.done % every == 0 or self.done == self.total:
            say(f"{self.label} {self.done}/{self.total}" + (f": {text}" if text else ""))

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
