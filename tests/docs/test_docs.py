"""Every ```python block in README.md and docs/*.md runs as written, and none is skipped.

Each block runs on its own, in a fresh namespace, with its own inputs: a reader can paste any
one of them. There is no way to mark a block as not run: a block that cannot run here (several
processes, a GPU) is not written as a ```python block. A block that imports verl or slime runs
against the real package when it is installed, else against the stand-in of
``examples/_standins.py`` (plain-loop restatements of the few functions the docs touch,
injected into ``sys.modules`` for that block only). Any other missing import fails the block.

``test_every_block_ran`` counts the blocks run in this session (running any that did not run
yet) and fails unless it equals the number of Python fences in the files, counted separately.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```\s*(?P<lang>[\w+-]*)\s*$")
IMPORT = re.compile(r"^\s*(?:from|import)\s+(?P<mod>[A-Za-z_]\w*)", re.MULTILINE)
#: any opening fence of Python code, also the forms the extractor does not read (indented,
#: ``~~~``, ``py``): counted separately so that such a block fails instead of never running
ANY_PYTHON_FENCE = re.compile(r"^\s*(```|~~~)\s*\{?\.?(python3?|py)\b", re.MULTILINE)
#: trainers whose documented call sites run against a stand-in where they are not installed
STANDIN_PACKAGES = ("verl", "slime")


def _load_standins():
    spec = importlib.util.spec_from_file_location("_rlops_standins", ROOT / "examples" /
                                                  "_standins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standins = _load_standins()


def extract_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` for each ```python block of ``path`` (line is 1-based)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if m.group("lang") == "python":
            blocks.append((start + 1, "\n".join(lines[start + 1 : j]) + "\n"))
        i = j + 1
    return blocks


CASES = [
    pytest.param(path, line, code, id=f"{path.relative_to(ROOT)}:{line}")
    for path in DOC_FILES
    for line, code in extract_blocks(path)
]
RAN: set[str] = set()  # ids of the blocks that ran to the end in this session


def run_block(path: Path, line: int, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run one block in a fresh namespace; verl / slime are stand-ins where absent."""
    name = f"{path.relative_to(ROOT)}:{line}"
    for mod in sorted(set(IMPORT.findall(code))):
        if importlib.util.find_spec(mod) is not None:
            continue
        if mod not in STANDIN_PACKAGES:
            pytest.fail(f"{name} imports {mod}, which is not installed")
        for dotted, module in standins.standin_modules(mod).items():
            monkeypatch.setitem(sys.modules, dotted, module)
    exec(compile(code, name, "exec"), {"__name__": "__doc_block__"})
    RAN.add(name)


def test_blocks_found():
    assert any(p.values[0].name == "README.md" for p in CASES)
    assert any(p.values[0].name == "integration.md" for p in CASES)


def test_extractor_reads_python_blocks_only(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("```python\na = 1\n```\n\ntext\n\n```python\nb = 2\n```\n```bash\nls\n```\n")
    assert extract_blocks(md) == [(1, "a = 1\n"), (7, "b = 2\n")]
    assert len(ANY_PYTHON_FENCE.findall(md.read_text())) == 2
    unread = tmp_path / "y.md"
    for text in ("~~~python\nc = 3\n~~~\n", "  ```python\nc = 3\n  ```\n", "```py\nc\n```\n"):
        unread.write_text(text)
        assert extract_blocks(unread) == []
        assert len(ANY_PYTHON_FENCE.findall(text)) == 1  # counted: test_every_block_ran fails


@pytest.mark.parametrize("path, line, code", CASES)
def test_doc_block_runs(path, line, code, monkeypatch):
    run_block(path, line, code, monkeypatch)


def test_every_block_ran():
    """The number of blocks run equals the number of Python fences: none was skipped."""
    fences = sum(len(ANY_PYTHON_FENCE.findall(p.read_text(encoding="utf-8"))) for p in DOC_FILES)
    assert len(CASES) == fences, "a Python block is fenced in a form the extractor does not read"
    for case in CASES:
        path, line, code = case.values
        if case.id not in RAN:  # deselected or run on another worker: run it here
            with pytest.MonkeyPatch.context() as mp:
                run_block(path, line, code, mp)
    assert len(RAN) == len(CASES) == fences
