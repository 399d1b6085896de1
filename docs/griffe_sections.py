"""A griffe extension for the reference pages (mkdocs.yml loads it; not part of the package).

rlops' docstrings are Google style as Napoleon reads it, and griffe's parser differs in three
places, which this extension rewrites before parsing:

- the singular heading ``Example:`` (Napoleon takes it; griffe only ``Examples:``) becomes the
  plural, so that its ``>>>`` lines render as code;
- one ``Args:`` entry for several parameters (``gamma, lam: ...``, as Napoleon allows) becomes
  one entry per parameter with the shared description, so each name is still checked against
  the signature;
- Sphinx roles (``:func:`aggregate_loss```) become code spans, and a line's closing ``::``
  (the literal block after it is an indented code block in Markdown too) a colon.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
ROLE = re.compile(r":(?:func|data|class|mod|meth|attr|obj|exc):`~?([^`]+)`")
LITERAL = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)
ARGS = re.compile(r"^(\s*)(?:Args|Arguments|Parameters|Params):\s*$")
SHARED = re.compile(r"^(\s+)(\*{0,2}\w+(?:,\s*\*{0,2}\w+)+)(\s*\([^)]*\))?:(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_shared_entries(text: str) -> str:
    """``a, b: description`` in an ``Args:`` section -> ``a: description`` and
    ``b: description`` (continuation lines repeated with each)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    section = None  # the indentation of the current Args heading
    while i < len(lines):
        line = lines[i]
        heading = ARGS.match(line)
        if heading:
            section = len(heading.group(1))
        elif section is not None and line.strip() and _indent(line) <= section:
            section = None
        entry = SHARED.match(line) if section is not None else None
        if entry is None or _indent(line) <= section:
            out.append(line)
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(line)):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():  # trailing blank lines stay after
            j -= 1
        indent, names, kind, rest = entry.groups()
        for name in re.split(r",\s*", names):
            out.append(f"{indent}{name}{kind or ''}:{rest}")
            out.extend(lines[i + 1 : j])
        i = j
    return "\n".join(out)


class NapoleonSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        value = HEADING.sub(r"\1Examples:", docstring.value)
        value = split_shared_entries(value)
        docstring.value = LITERAL.sub(":", ROLE.sub(r"`\1`", value))
