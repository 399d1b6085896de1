"""The result of a contract: one :class:`Check` per named check, gathered in a :class:`Report`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["Check", "ContractError", "Report"]


class ContractError(AssertionError):
    """Raised by :meth:`Report.raise_if_failed`; its message is the report's table."""


class _Named(Protocol):
    @property
    def name(self) -> str: ...


_N = TypeVar("_N", bound=_Named)


def by_name(items: Sequence[_N], name: str, what: str) -> _N:
    """The item of ``items`` called ``name``; a ``KeyError`` listing the names otherwise."""
    for item in items:
        if item.name == name:
            return item
    raise KeyError(f"no {what} named {name!r}: they are {[i.name for i in items]}")


@dataclass(frozen=True)
class Check:
    """One named check of a contract.

    Attributes:
        name: the check's name (``"values"``, ``"vocab_tail"``, ...).
        ok: True (passed), False (failed) or None (not applicable to this function: skipped).
        value: the measured figure as a number (a largest error, a largest difference), or None.
        figure: the measured figure in words, with the bound it was held to.
        explanation: one line: what a failure of this check usually means in a trainer.
    """

    name: str
    ok: bool | None
    value: float | None
    figure: str
    explanation: str

    @property
    def status(self) -> str:
        """``"ok"``, ``"FAIL"`` or ``"skip"``."""
        return {True: "ok", False: "FAIL", None: "skip"}[self.ok]


class Report:
    """The checks of one contract run on one function.

    Truthy when every check passed or was skipped, so ``assert report`` works in a test (the
    assertion message shows the table); :meth:`raise_if_failed` raises with the table.

    Example:
        >>> r = Report("demo", [Check("values", True, 1e-7, "max error 1e-07", "wrong maths"),
        ...                     Check("gradients", False, None, "no gradient", "detached")])
        >>> r.ok, r.failed, bool(r)
        (False, ['gradients'], False)
        >>> r["values"].value
        1e-07
    """

    def __init__(self, title: str, checks: list[Check]) -> None:
        self.title = title
        self.checks = tuple(checks)

    @property
    def ok(self) -> bool:
        """Whether no check failed."""
        return not self.failed

    @property
    def failed(self) -> list[str]:
        """The names of the failed checks, in the contract's order."""
        return [c.name for c in self.checks if c.ok is False]

    def __bool__(self) -> bool:
        return self.ok

    def __iter__(self) -> Iterator[Check]:
        return iter(self.checks)

    def __getitem__(self, name: str) -> Check:
        return by_name(self.checks, name, "check")

    def __str__(self) -> str:
        names = [c.name for c in self.checks]
        width = max([len("check"), *map(len, names)])
        lines = [self.title, f"{'check':<{width}}  {'result':<6}  measured"]
        lines.append("-" * len(lines[-1]) + "-" * 40)
        lines += [f"{c.name:<{width}}  {c.status:<6}  {c.figure}" for c in self.checks]
        failed = [c for c in self.checks if c.ok is False]
        verdict = "all checks passed" if not failed else f"{len(failed)} failed"
        lines.append(f"{verdict} ({len(self.checks)} checks)")
        lines += [f"  {c.name}: {c.explanation}" for c in failed]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return "\n" + str(self)

    def raise_if_failed(self) -> None:
        """Raise :class:`ContractError` (an ``AssertionError``) with the table if a check
        failed."""
        if not self.ok:
            raise ContractError(str(self))
