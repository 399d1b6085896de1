"""Every ```python block in README.md and docs/*.md runs as written.

Each block runs on its own, in a fresh namespace: a reader can paste any one of them. A block is
skipped only when it is marked by an HTML comment on the line before its fence (blank lines
between are allowed) that starts with ``<!-- not run`` and gives a reason, e.g.
``<!-- not run: needs torch.distributed with several processes -->``, or when it imports a
trainer (verl, slime, ...) that is not installed here, as ``pytest.importorskip`` would.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARK = re.compile(r"^\s*<!--\s*not run\b(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^```\s*(?P<lang>[\w+-]*)\s*$")
IMPORT = re.compile(r"^\s*(?:from|import)\s+(?P<mod>[A-Za-z_]\w*)", re.MULTILINE)


def extract_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip_reason)`` for each ```python block of ``path`` (line is 1-based)."""
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
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            reason = None
            if k >= 0 and (s := SKIP_MARK.match(lines[k])):
                reason = s.group("reason").strip(" :-—") or "marked not run"
            blocks.append((start + 1, "\n".join(lines[start + 1 : j]) + "\n", reason))
        i = j + 1
    return blocks


CASES = [
    pytest.param(path, line, code, reason, id=f"{path.relative_to(ROOT)}:{line}")
    for path in DOC_FILES
    for line, code, reason in extract_blocks(path)
]


def test_blocks_found():
    assert any(p.values[0].name == "README.md" for p in CASES)


def test_extractor_honours_the_mark(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "```python\na = 1\n```\n\n<!-- not run: needs two processes -->\n\n"
        "```python\nb = 2\n```\n```bash\nls\n```\n"
    )
    assert extract_blocks(md) == [(1, "a = 1\n", None), (7, "b = 2\n", "needs two processes")]


@pytest.mark.parametrize("path, line, code, reason", CASES)
def test_doc_block_runs(path, line, code, reason):
    if reason is not None:
        pytest.skip(reason)
    for mod in set(IMPORT.findall(code)):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {mod}, not installed")
    namespace = {"__name__": "__doc_block__"}
    exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)
