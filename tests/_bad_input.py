"""The pattern that bad-input tests match an error message against: it names the argument."""

from __future__ import annotations

import re

__all__ = ["names"]


def names(arg: str) -> str:
    """A pattern for a message that names ``arg`` as a word (``x`` must not match
    ``expected``; verl's dotted option names such as ``config.clip_ratio`` count as one
    word, so ``clip_ratio`` does not match inside them)."""
    return rf"(?<![\w.]){re.escape(arg)}\b"
