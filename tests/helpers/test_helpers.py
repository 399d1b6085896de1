"""The tests' own helper modules state what they offer: every name a test imports from
``tests/tolerances.py`` or ``tests/_losses_util.py`` is in that module's ``__all__``."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _imported(module: str) -> dict[str, list[str]]:
    """name -> the test files that import it from ``module``."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                for alias in node.names:
                    found.setdefault(alias.name, []).append(path.name)
    return found


@pytest.mark.parametrize("module", ["tests.tolerances", "tests._losses_util"])
def test_what_tests_import_is_in_all(module):
    names = importlib.import_module(module).__all__
    assert names == sorted(names), f"{module}.__all__ is not sorted"
    imported = _imported(module)
    assert imported, f"no test imports from {module}"
    missing = {n: files for n, files in imported.items() if n not in names}
    assert not missing, f"imported from {module} but not in its __all__: {missing}"
