"""How ``src/rlops`` reads: short functions, docstrings that state the maths and stop, each
family in its package, private modules that export nothing, tests named by concept.

Run as a script (``python -m tests.package.test_layout``) it prints the figures: files and lines
per package, the longest functions and docstrings, and the docstrings' share of the source.
"""

from __future__ import annotations

import ast
import collections
import pathlib
from collections.abc import Iterator

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "rlops"
TESTS = SRC.parents[1] / "tests"

MAX_FUNCTION_LINES = 150
MAX_DOCSTRING_LINES = 80
MAX_DOCSTRING_SHARE = 0.20
MAX_LOGPROBS_MODULES = 11
MIN_LOGPROBS_MODULE_LINES = 60

#: public import paths kept as thin re-export modules; their families live in packages
KEPT_PATHS = {
    "kl_controllers.py": "rlops.losses",
    "selection.py": "rlops.corrections",
    "rollout_correction.py": "rlops.corrections",
    "group_advantages.py": "rlops.advantages",
}
#: the modules at the top of ``src/rlops`` besides the kept paths
TOP = {"__init__.py", "stats.py", "_backends.py", "_checks.py", "_numerics.py", "_threads.py"}
TOP |= {"_triton.py", "_types.py"}


def _files() -> list[pathlib.Path]:
    return sorted(SRC.rglob("*.py"))


def _docstring(node: ast.AST) -> ast.Expr | None:
    if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0]
    return None


def _walk(path: pathlib.Path) -> Iterator[ast.AST]:
    yield from ast.walk(ast.parse(path.read_text(), str(path)))


def _functions() -> list[tuple[int, str]]:
    """``(lines, "path:name")`` for every function and method."""
    out = []
    for path in _files():
        for node in _walk(path):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                end = node.end_lineno or node.lineno
                out.append((end - node.lineno + 1, f"{path.relative_to(SRC)}:{node.name}"))
    return sorted(out, reverse=True)


def _docstrings() -> list[tuple[int, str]]:
    """``(lines, "path:owner")`` for every module, class and function docstring."""
    out = []
    for path in _files():
        for node in _walk(path):
            doc = _docstring(node)
            if doc is not None:
                owner = getattr(node, "name", "<module>")
                lines = (doc.end_lineno or doc.lineno) - doc.lineno + 1
                out.append((lines, f"{path.relative_to(SRC)}:{owner}"))
    return sorted(out, reverse=True)


def _source_lines() -> int:
    return sum(len(p.read_text().splitlines()) for p in _files())


def _private(path: pathlib.Path) -> bool:
    parts = path.relative_to(SRC).with_suffix("").parts
    return any(p.startswith("_") and p != "__init__" for p in parts)


def _declares_all(path: pathlib.Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_no_function_over_150_lines():
    long = [f"{w} ({n})" for n, w in _functions() if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_docstring_over_80_lines():
    long = [f"{w} ({n})" for n, w in _docstrings() if n > MAX_DOCSTRING_LINES]
    assert not long, f"docstrings over {MAX_DOCSTRING_LINES} lines: {long}"


def test_docstrings_are_at_most_a_fifth_of_the_source():
    share = sum(n for n, _ in _docstrings()) / _source_lines()
    assert share <= MAX_DOCSTRING_SHARE, f"docstrings are {share:.1%} of src/rlops"


def test_private_modules_declare_no_all():
    exporting = [str(p.relative_to(SRC)) for p in _files() if _private(p) and _declares_all(p)]
    assert not exporting, f"private modules declaring __all__: {exporting}"


def test_logprobs_modules_are_few_and_whole():
    modules = sorted((SRC / "logprobs").glob("*.py"))
    assert len(modules) <= MAX_LOGPROBS_MODULES, [p.name for p in modules]
    small = [
        p.name
        for p in modules
        if p.name != "__init__.py" and len(p.read_text().splitlines()) < MIN_LOGPROBS_MODULE_LINES
    ]
    assert not small, f"logprobs modules under {MIN_LOGPROBS_MODULE_LINES} lines: {small}"


def test_families_live_in_their_packages():
    """At the top of ``src/rlops`` only the layer-0 modules, ``stats.py`` and the kept public
    paths, which only re-export (no function or class of their own)."""
    top = {p.name for p in SRC.glob("*.py")}
    assert top <= TOP | set(KEPT_PATHS), sorted(top - TOP - set(KEPT_PATHS))
    for name, package in KEPT_PATHS.items():
        path = SRC / name
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defined, f"{name} defines {defined}: it only re-exports {package}"
        sources = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)} - {"__future__"}
        assert sources and all(s and s.startswith(package) for s in sources), (name, sources)


def test_tests_are_named_by_concept():
    historical = sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if p.stem.endswith("_recent")
    )
    assert not historical, f"test modules named by history: {historical}"


def _report() -> None:
    files = collections.Counter()
    lines = collections.Counter()
    for path in _files():
        rel = path.relative_to(SRC)
        package = rel.parts[0] if len(rel.parts) > 1 else "(top)"
        files[package] += 1
        lines[package] += len(path.read_text().splitlines())
    total = _source_lines()
    docs = sum(n for n, _ in _docstrings())
    share = f"docstrings {docs} ({docs / total:.1%})"
    print(f"src/rlops: {sum(files.values())} files, {total} lines, {share}")
    for package in sorted(files):
        print(f"  {package:14s} {files[package]:3d} files {lines[package]:6d} lines")
    print("longest functions:", *(f"  {n:4d} {w}" for n, w in _functions()[:8]), sep="\n")
    print("longest docstrings:", *(f"  {n:4d} {w}" for n, w in _docstrings()[:8]), sep="\n")


if __name__ == "__main__":
    _report()
