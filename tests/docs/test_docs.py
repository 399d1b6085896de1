"""Every ```python block in README.md and in every page under docs/ runs as written, and none is
skipped; every relative link of those files resolves; the site's reference and map cover what
they must (every public name, every page in the nav, every module in the architecture map).

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

import importlib
import importlib.util
import re
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```\s*(?P<lang>[\w+-]*)\s*$")
IMPORT = re.compile(r"^\s*(?:from|import)\s+(?P<mod>[A-Za-z_]\w*)", re.MULTILINE)
#: any opening fence of Python code, also the forms the extractor does not read (indented,
#: ``~~~``, ``py``): counted separately so that such a block fails instead of never running
#: (spaces and tabs only: a bare ``` followed by a line starting "python" is not one)
ANY_PYTHON_FENCE = re.compile(r"^[ \t]*(```|~~~)[ \t]*\{?\.?(python3?|py)\b", re.MULTILINE)
#: trainers whose documented call sites run against a stand-in where they are not installed
STANDIN_PACKAGES = ("verl", "slime")


def _load_standins():
    spec = importlib.util.spec_from_file_location(
        "_rlops_standins", ROOT / "examples" / "_standins.py"
    )
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
    assert ANY_PYTHON_FENCE.findall("```\npython script.py\n```\n") == []  # a shell line


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


# --------------------------------------------------------------------------- links and coverage
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
DIRECTIVE = re.compile(r"^::: (?P<id>[\w.]+)\s*$", re.MULTILINE)
HEADING = re.compile(r"^#{1,6} (?P<text>.+?)\s*$", re.MULTILINE)
CODE_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
SITE_PAGES = sorted((ROOT / "docs").rglob("*.md"))


def slug(heading: str) -> str:
    """The anchor of a heading, as Python-Markdown's toc extension (mkdocs) writes it."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The headings' anchors of ``page`` and the ids of its ``::: name`` reference directives."""
    text = CODE_BLOCK.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group("text")) for m in HEADING.finditer(text)} | set(DIRECTIVE.findall(text))


def links(text: str) -> list[str]:
    """The relative link targets of a page's ``text``, code blocks left out."""
    text = CODE_BLOCK.sub("", text)
    return [
        t for t in (m.group("target") for m in LINK.finditer(text)) if not re.match(r"[a-z]+:", t)
    ]


def test_link_extractor():
    md = "[a](x.md#h) ![i](p.png) [w](https://e.org) [s](#top)\n```\n[c](no.md)\n```\n"
    assert links(md) == ["x.md#h", "p.png", "#top"]
    assert slug("`rlops bench`: PPO, end to end") == "rlops-bench-ppo-end-to-end"
    assert slug("Log-probs and entropy, fused") == "log-probs-and-entropy-fused"


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_relative_links_resolve(path):
    """Each relative link names a file of the source tree, and its anchor (if any) a heading or
    a reference directive of that page. mkdocs checks the site's pages too; the README is
    read on GitHub, outside the site, so this is its only check."""
    bad = []
    for target in links(path.read_text(encoding="utf-8")):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading or ::: {anchor} in {dest.relative_to(ROOT)}")
    assert not bad, bad


def test_reference_pages_cover_the_public_api():
    """Every name of rlops.__all__ has a reference directive (its public path, or the path of
    the module that defines it where a submodule of the same name shadows it), every
    directive names an importable object; rlops.distributed, rlops.kl_controllers, each public
    rlops.compat module and rlops.testing have theirs. (The README links each name to its
    definition in the source: tests/docs/test_rendered_reference.py checks those links.)"""
    import rlops

    directives = {
        d: page
        for page in (ROOT / "docs" / "reference").glob("*.md")
        for d in DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    }
    for ident in directives:
        module, _, attr = ident.rpartition(".")
        try:
            obj = importlib.import_module(ident)
        except ImportError:
            obj = getattr(importlib.import_module(module), attr, None)
        assert obj is not None, f"::: {ident} names nothing importable"
    by_object = {}
    for ident in directives:
        module, _, attr = ident.rpartition(".")
        if attr and importlib.util.find_spec(module) is not None:
            by_object.setdefault(id(getattr(importlib.import_module(module), attr, None)), ident)
    for name in rlops.__all__:
        ident = by_object.get(id(getattr(rlops, name)))
        assert ident is not None, f"rlops.{name} has no ::: directive under docs/reference/"
    src = ROOT / "src" / "rlops"
    adapters = [f"rlops.compat.{p.parent.name}" for p in (src / "compat").glob("[!_]*/__init__.py")]
    assert adapters, "no adapter package under src/rlops/compat"
    required = ["rlops.distributed", "rlops.kl_controllers", *sorted(adapters)]
    if (src / "testing").is_dir():
        required.append("rlops.testing")
    missing = [m for m in required if m not in directives]
    assert not missing, f"no reference page for {missing}"


def test_every_page_is_in_the_nav():
    """mkdocs only notes a page left out of the nav; here it fails."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:") :]
    missing = [
        p.relative_to(ROOT / "docs").as_posix()
        for p in SITE_PAGES
        if f": {p.relative_to(ROOT / 'docs').as_posix()}\n" not in nav
    ]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_the_architecture_map_names_every_module():
    """docs/architecture.md names each module of src/rlops by its path under src/rlops/."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    src = ROOT / "src" / "rlops"
    modules = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.py"))
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_the_reference_reads_napoleon_sections():
    """docs/griffe_sections.py (the site's griffe extension) splits ``a, b: ...`` entries of an
    ``Args:`` section into one entry per parameter, and leaves other sections alone."""
    pytest.importorskip("griffe", reason="the docs extra: pip install -e '.[docs]'")
    spec = importlib.util.spec_from_file_location(
        "griffe_sections", ROOT / "docs" / "griffe_sections.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (
        "Sum.\n\nArgs:\n    a: one.\n    b, c: two\n        lines.\n\nReturns:\n    x, y: kept.\n"
    )
    assert module.split_shared_entries(text) == (
        "Sum.\n\nArgs:\n    a: one.\n    b: two\n        lines.\n    c: two\n        lines.\n"
        "\nReturns:\n    x, y: kept.\n"
    )
