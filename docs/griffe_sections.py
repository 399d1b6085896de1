"""A griffe extension for the reference pages (mkdocs.yml loads it; not part of the package).

rlops' docstrings are Google style as Napoleon reads it, and griffe's parser differs in three
places, which this extension rewrites before parsing:

- the singular heading ``Example:`` (Napoleon takes it; griffe only ``Examples:``) becomes the
  plural, so that its ``>>>`` lines render as code;
- one ``Args:`` entry for several parameters (``gamma, lam: ...``, as Napoleon allows) becomes
  one entry per parameter with the shared description, so each name is still checked against
  the signature;
- Sphinx roles (``:func:`aggregate_loss```) become code spans, and a line's closing ``::``
  (the literal block after it is an indented code block in Markdown too) a colon;
- a function that takes ``**options: Unpack[SomeOptions]`` documents those keywords under
  ``Other Parameters:``; each entry gets its type from the ``TypedDict`` (the one declaration
  of them), as ``name (type):``.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import griffe

HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
ROLE = re.compile(r":(?:func|data|class|mod|meth|attr|obj|exc):`~?([^`]+)`")
LITERAL = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)
ARGS = re.compile(r"^(\s*)(?:Args|Arguments|Parameters|Params):\s*$")
OTHER = re.compile(r"^(\s*)Other Parameters:\s*$")
ENTRY = re.compile(r"^(\s+)(\w+):(.*)$")
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


def _unpacked_types(obj: griffe.Object) -> dict[str, str]:
    """``{key: annotation}`` of the ``TypedDict`` in a ``**options: Unpack[...]`` parameter of
    the function ``obj`` (its own keys and those it inherits), or ``{}``."""
    if not isinstance(obj, griffe.Function):
        return {}
    for p in obj.parameters:
        ann = p.annotation
        if p.kind is not griffe.ParameterKind.var_keyword or not isinstance(
            ann, griffe.ExprSubscript
        ):
            continue
        if str(ann.left) != "Unpack":
            continue
        module, _, name = str(ann.slice.canonical_path).rpartition(".")
        options = getattr(importlib.import_module(module), name)
        hints = options.__annotations__.items()  # strings, or ForwardRefs of them
        return {k: getattr(v, "__forward_arg__", str(v)) for k, v in hints}
    return {}


def typed_other_parameters(text: str, types: dict[str, str]) -> str:
    """``name:`` entries of an ``Other Parameters:`` section -> ``name (type):``."""
    lines = text.split("\n")
    section = None  # the indentation of the Other Parameters heading
    entry_indent = None
    for i, line in enumerate(lines):
        heading = OTHER.match(line)
        if heading:
            section, entry_indent = len(heading.group(1)), None
            continue
        if section is None or not line.strip():
            continue
        if _indent(line) <= section:
            section = None
            continue
        entry = ENTRY.match(line)
        if entry_indent is None:
            entry_indent = _indent(line)
        if entry and _indent(line) == entry_indent and entry.group(2) in types:
            indent, name, rest = entry.groups()
            lines[i] = f"{indent}{name} ({types[name]}):{rest}"
    return "\n".join(lines)


class NapoleonSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        value = HEADING.sub(r"\1Examples:", docstring.value)
        value = split_shared_entries(value)
        types = _unpacked_types(obj)
        if types:
            value = typed_other_parameters(value, types)
        docstring.value = LITERAL.sub(":", ROLE.sub(r"`\1`", value))
