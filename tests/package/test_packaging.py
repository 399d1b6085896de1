"""The package as published: metadata in pyproject.toml, the sdist's file list, the wheel.

The sdist must carry what the tests read (``tests/`` with its helpers, ``benchmarks/``, the docs
whose snippets run, ``.ci/run``), so that ``python -m pytest`` runs from an unpacked sdist. The
build runs on a copy of the source tree in a temporary directory, without build isolation
(``build`` and ``setuptools>=77`` come with the ``test`` extra); without them the build tests
skip.
"""

from __future__ import annotations

import email
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import rlops

ROOT = Path(__file__).resolve().parents[2]
SKIP = {
    ".git",
    ".venv",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    "build",
    "dist",
}


def _toml() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --------------------------------------------------------------------------- metadata
def test_license_is_an_spdx_expression_with_its_file():
    project = _toml()["project"]
    assert project["license"] == "Apache-2.0"  # the string form, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it
    # a License classifier beside an SPDX expression is an error for setuptools >= 77
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_build_backend_understands_the_license_expression():
    requires = _toml()["build-system"]["requires"]
    found = [m for r in requires if (m := re.match(r"setuptools\s*>=\s*(\d+)", r))]
    assert found, requires
    minimum = int(found[0].group(1))
    assert minimum >= 77, f"license = 'Apache-2.0' needs setuptools>=77, got {requires}"


def test_version_is_written_once():
    data = _toml()
    assert "version" not in data["project"]
    assert "version" in data["project"]["dynamic"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rlops.__version__"}
    written = re.findall(
        r'^__version__ = "([^"]+)"', (ROOT / "src" / "rlops" / "__init__.py").read_text(), re.M
    )
    assert written == [rlops.__version__]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {rlops.__version__}" in changelog, "no CHANGELOG entry for this version"


def test_test_extra_has_what_the_build_tests_need():
    extra = _toml()["project"]["optional-dependencies"]["test"]
    names = {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0] for r in extra}
    assert {"pytest", "hypothesis", "build", "setuptools"} <= names


def test_readme_test_command_is_what_ci_runs():
    """The README's second command line is run verbatim by ``.ci/run``."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block, "README.md has no ```bash block"
    lines = block.group(1).strip().splitlines()
    assert "torch==2.13.0" in lines[1] and "pytest" in lines[1]
    assert lines[1] in (ROOT / ".ci" / "run").read_text().splitlines()


# --------------------------------------------------------------------------- sdist and wheel
def _needs_build() -> None:
    if importlib.util.find_spec("build") is None:
        pytest.skip("the sdist check needs `build` (pip install -e '.[test]')")
    try:
        import setuptools
    except ImportError:
        pytest.skip("the sdist check needs setuptools>=77 (pip install -e '.[test]')")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"the sdist check needs setuptools>=77, found {setuptools.__version__}")


def _build(tmp_path: Path, kind: str) -> Path:
    _needs_build()
    src = tmp_path / "src-tree"
    shutil.copytree(
        ROOT,
        src,
        ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".egg-info")],
    )
    out = tmp_path / "dist"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            f"--{kind}",
            "--no-isolation",
            "--outdir",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (built,) = out.iterdir()
    return built


def _tree_files(*patterns: str) -> set[str]:
    """Files of the source tree that match ``patterns`` (relative paths), caches left out."""
    return {
        p.relative_to(ROOT).as_posix()
        for pattern in patterns
        for p in ROOT.glob(pattern)
        if p.is_file() and not SKIP.intersection(p.relative_to(ROOT).parts)
    }


@pytest.mark.slow
def test_sdist_carries_what_the_tests_read(tmp_path):
    sdist = _build(tmp_path, "sdist")
    assert sdist.name == f"rlops-{rlops.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        top = f"rlops-{rlops.__version__}/"
        names = {m.name[len(top) :] for m in tar.getmembers() if m.isfile()}
        pkg_info = email.message_from_bytes(tar.extractfile(top + "PKG-INFO").read())
    needed = _tree_files(
        "tests/**/*.py",
        "src/rlops/**/*.py",
        "benchmarks/*.py",
        "examples/*.py",
        "docs/**/*.md",
        "docs/**/*.png",
    )
    needed |= {
        "README.md",
        "LICENSE",
        "CHANGELOG.md",
        "pyproject.toml",
        "mkdocs.yml",
        ".ci/run",
        "src/rlops/py.typed",
    }
    missing = sorted(needed - names)
    assert not missing, f"the sdist lacks {missing}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert pkg_info["Version"] == rlops.__version__
    assert pkg_info["License-Expression"] == "Apache-2.0"
    assert pkg_info.get_all("License-File") == ["LICENSE"]
    assert pkg_info["Requires-Python"] == ">=3.10"


@pytest.mark.slow
def test_wheel_holds_the_package_and_the_license_only(tmp_path):
    wheel = _build(tmp_path, "wheel")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    tops = {n.split("/")[0] for n in names}
    assert tops == {"rlops", f"rlops-{rlops.__version__}.dist-info"}, tops
    assert "rlops/py.typed" in names
    assert f"rlops-{rlops.__version__}.dist-info/licenses/LICENSE" in names
    expected = {
        p.relative_to(ROOT / "src").as_posix()
        for p in (ROOT / "src" / "rlops").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert expected <= names, sorted(expected - names)


def test_mypy_passes_without_the_optional_dependencies():
    """A contributor with ``.[dev]`` alone runs ``mypy src``: every optional dependency or peer
    that src imports (lazily) is in the ignore_missing_imports override, so mypy does not fail
    where it is not installed."""
    import ast

    # torch and its own dependencies; numpy (the test extra) and packaging (pytest's) come with
    # .[dev] and carry their own types
    hard = {"torch", "typing_extensions", "rlops", "__future__", "numpy", "packaging"}
    found: set[str] = set()
    for path in (ROOT / "src" / "rlops").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found |= {n.split(".")[0] for n in names}
    third_party = {
        n for n in found - hard if n not in sys.stdlib_module_names and not n.startswith("_")
    }
    overrides = _toml()["tool"]["mypy"]["overrides"]
    ignored = {m for o in overrides if o.get("ignore_missing_imports") for m in o["module"]}
    missing = sorted(n for n in third_party if n not in ignored and f"{n}.*" not in ignored)
    assert not missing, f"add to [[tool.mypy.overrides]] ignore_missing_imports: {missing}"
