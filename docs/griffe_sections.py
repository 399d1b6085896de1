"""A griffe extension for the reference pages (mkdocs.yml loads it; not part of the package).

rlops' docstrings are Google style as Napoleon reads it: griffe's parser takes ``Examples:``
but not the singular ``Example:`` (Napoleon takes both), and Sphinx roles such as
``:func:`aggregate_loss``` and the ``::`` that opens a literal block would show as written.
Before parsing, the singular heading becomes the plural (so ``>>>`` blocks render as code),
each role becomes a code span, and a line's closing ``::`` a colon (the indented block after
it is a code block in Markdown too).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
ROLE = re.compile(r":(?:func|data|class|mod|meth|attr|obj|exc):`~?([^`]+)`")
LITERAL = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)


class NapoleonSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        value = HEADING.sub(r"\1Examples:", docstring.value)
        docstring.value = LITERAL.sub(":", ROLE.sub(r"`\1`", value))
