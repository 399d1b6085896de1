"""The site as a reader sees it, and the README's links into the API.

**The rendered reference.** The site is built once (``mkdocs build --strict`` into a temporary
folder, as CI builds it) and its reference pages are read as HTML, after mkdocstrings and the
griffe extension have done their rewriting: no reST or LaTeX source may be left in them (a
``.. math::`` directive, ``:func:`` roles, ``\\frac``, `` `text <url>`_ `` links, ``:param:``
fields), since the site renders neither (the docstrings write their maths in Unicode, in
``::`` blocks). Every URL of their prose is a link. The signatures are formatted (the docs
extra installs ruff, without which mkdocstrings prints each signature as one clipped line) and
an overloaded function shows one signature, not one per overload.

**The README's API links.** The README is read on GitHub, in an editor, on PyPI: outside the
site, where ``docs/reference/*.md`` holds only ``::: rlops.name`` directives. So each name of
its "The public API" section links to its definition in the source, ``src/rlops/<module>.py#L<n>``,
the ``def`` or ``class`` line that the docstring follows (a module: its file, whose docstring
opens it). Line numbers move when code above a definition changes; this test names the right
ones, and ``python tests/docs/test_rendered_reference.py --write-readme`` rewrites the
section's links to them (only the link targets of that section).
"""

from __future__ import annotations

import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## The public API"

# --------------------------------------------------------------------------- raw markup
#: reST and LaTeX source that the site does not render; each pattern is named in the failure
RAW_MARKUP = {
    "reST directive": re.compile(r"(?m)^\s*\.\. [a-z][\w-]*::?(?:\s|$)"),
    "reST role": re.compile(r":(?:[a-z]+:)?[a-z]+:`"),
    "reST link": re.compile(r"<https?://[^>\s]+>`?_|`_(?!\w)"),
    "reST field": re.compile(r"(?m)^\s*:(?:param|type|returns?|rtype|raises?)\b[^:]*:"),
    "reST literal": re.compile(r"``"),
    # named commands (a Python escape such as "\\nb" is not one), or any command taking {...}
    "LaTeX command": re.compile(
        r"\\(?:[dt]?frac|operatorname|math[a-z]+|text[a-z]*|left|right|[bB]igg?|q?quad|c?dots"
        r"|ldots|cdot|times|sum|prod|int|log|exp|tanh|sqrt|hat|bar|tilde|top|[lg]eq?|neq"
        r"|approx|in|infty|partial|nabla|alpha|beta|gamma|delta|(?:var)?epsilon|lambda|mu|pi"
        r"|rho|sigma|tau|theta|(?:var)?phi|psi|omega|Sigma|Delta|Pi)(?![A-Za-z])|\\[A-Za-z]+\{"
    ),
    "LaTeX delimiter": re.compile(r"\$\$|\\[()\[\]]"),
}


def raw_markup(text: str) -> list[str]:
    """``"kind: line"`` for each line of ``text`` that holds reST or LaTeX source."""
    found = []
    for line in text.splitlines():
        for kind, pattern in RAW_MARKUP.items():
            if pattern.search(line):
                found.append(f"{kind}: {line.strip()[:120]}")
    return found


def test_the_raw_markup_check():
    """Known-bad lines are all found, known-good ones never (the checker itself is tested)."""
    bad = [
        ".. math::",
        "  .. math:",  # the griffe extension turns a closing :: into :
        ".. note::",
        "see :func:`rlops.gae` and :math:`x`",
        ":py:func:`f`",
        r"\log p_y = z_y - \operatorname{lse}(z), \qquad",
        r"z = c \tanh\!\left(\frac{s \cdot \mathrm{logits}}{c}\right) / \tau",
        r"H = \sum_v p_v",
        r"x \in \mathbb{R}",
        r"\newcommand{\x}",
        "(arXiv 2602.07078 <https://arxiv.org/abs/2602.07078>_) sums",
        "`arXiv <https://arxiv.org/abs/1>`_",
        "see `the paper`_",
        ":param x: the input",
        ":returns: the output",
        "drawn with ``generator``",
        "$$x^2$$",
        r"\(x\)",
    ]
    good = [
        "log p_y = z_y − lse(z)        H = lse(z) − Σ_v softmax(z)_v · z_v",
        "z = c·tanh(s·logits / c) / τ",
        "(OTB, https://arxiv.org/abs/2602.07078) sums into its weights",
        "[the paper](https://arxiv.org/abs/2602.07078)",
        ">>> print('a\\nb')",
        ">>> re.findall(r'\\bword\\b', text)",
        '>>> d = {"x": 1, "y": [1, 2]}',
        'k2, "mse"      d² / 2',
        "abs            |d|",
        "x: torch.Tensor = ...",
        "ppo_kl of kl_cov is the mean |lr| (here ppo_kl_abs).",
        "a::b and x_ = 1",
        "M2 = (1/|K|)·Σ_{t∈K} d_t²",
    ]
    for line in bad:
        assert raw_markup(line), f"missed: {line}"
    for line in good:
        assert not raw_markup(line), f"false alarm: {line} -> {raw_markup(line)}"


# --------------------------------------------------------------------------- the built site
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``(folder, build output)`` of ``mkdocs build --strict``, as CI runs it."""
    for module in ("mkdocs", "mkdocstrings_handlers.python", "material"):
        pytest.importorskip(module, reason="the docs extra: pip install -e '.[docs]'")
    folder = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(folder)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    return folder, output


REFERENCE_PAGES = sorted(p.stem for p in (ROOT / "docs" / "reference").glob("*.md"))


def article(site_folder: Path, page: str) -> str:
    """The HTML of a built reference page's content (navigation left out)."""
    text = (site_folder / "reference" / page / "index.html").read_text(encoding="utf-8")
    m = re.search(r"<article\b.*?</article>", text, re.DOTALL)
    assert m, f"reference/{page}: no <article> in the built page"
    return m.group(0)


def visible_text(fragment: str) -> str:
    """What a reader sees of an HTML fragment: the tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


@pytest.mark.parametrize("page", REFERENCE_PAGES)
def test_no_raw_rest_or_latex_on_the_reference_pages(site, page):
    found = raw_markup(visible_text(article(site[0], page)))
    assert not found, f"reference/{page} shows source markup:\n" + "\n".join(found)


@pytest.mark.parametrize("page", REFERENCE_PAGES)
def test_urls_in_the_reference_prose_are_links(site, page):
    """A docstring's bare URL renders as a link (mkdocs.yml's pymdownx.magiclink); in code
    blocks and code spans it stays text."""
    prose = re.sub(r"<(pre|code|a)\b.*?</\1>", "", article(site[0], page), flags=re.DOTALL)
    urls = re.findall(r"https?://\S+", visible_text(prose))
    assert not urls, f"reference/{page}: URLs that are not links: {urls}"


def test_the_signatures_are_formatted(site):
    """No 'Formatting signatures requires either Black or Ruff' in the build, and every
    signature of the reference is cut into lines (without a formatter each is one line)."""
    folder, output = site
    assert "Formatting signatures requires" not in output, (
        "mkdocstrings found neither ruff nor black: add one to the docs extra"
    )
    too_long = []
    for page in REFERENCE_PAGES:
        for block in re.findall(
            r'<div class="doc-signature[^"]*">(.*?)</div>', article(folder, page), re.DOTALL
        ):
            for line in visible_text(block).splitlines():
                if len(line) > 100:
                    too_long.append(f"reference/{page}: {line[:80]}...")
    assert not too_long, too_long


@pytest.mark.parametrize("page", REFERENCE_PAGES)
def test_each_function_shows_one_signature(site, page):
    """An overloaded function (logprobs_and_entropy has 7 overloads) shows its signature once:
    each function's part of the page (up to the next documented object) holds one signature."""
    parts = re.split(r'(?=<div class="doc doc-object )', article(site[0], page))
    counts = {}
    for part in parts:
        if part.startswith('<div class="doc doc-object doc-function'):
            name = re.search(r'id="([^"]+)"', part).group(1)
            counts[name] = part.count('class="doc-signature')
    assert all(n == 1 for n in counts.values()), {k: n for k, n in counts.items() if n != 1}
    if page == "logprobs":
        assert counts.get("rlops.logprobs_and_entropy") == 1, counts


# --------------------------------------------------------------------------- the README's links
LINK = re.compile(r"\[`(?P<name>[\w.]+)`\]\((?P<target>[^)\s]+)\)")


def api_section(text: str) -> tuple[int, int]:
    """``(start, end)`` offsets of the README's "The public API" section."""
    start = text.index(f"\n{SECTION}\n") + 1
    nxt = text.find("\n## ", start + len(SECTION))
    return start, len(text) if nxt < 0 else nxt + 1


def resolve(name: str):
    """The object a README name stands for: ``gae`` is ``rlops.gae``, ``rlops.x.y`` a module
    (or an attribute of one)."""
    import rlops

    if not name.startswith("rlops."):
        return getattr(rlops, name)
    if importlib.util.find_spec(name) is not None:
        return importlib.import_module(name)
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def source_target(obj) -> str:
    """``src/rlops/...py#L<n>``, the line of ``obj``'s ``def`` or ``class`` (decorators
    skipped); for a module its file, whose docstring opens it."""
    if not inspect.ismodule(obj):
        obj = inspect.unwrap(obj)  # a checking wrapper's own source is elsewhere
    path = Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT).as_posix()
    if inspect.ismodule(obj):
        return path
    lines, start = inspect.getsourcelines(obj)
    offset = next(
        i for i, line in enumerate(lines) if re.match(r"\s*(?:async\s+def|def|class)\s", line)
    )
    return f"{path}#L{start + offset}"


def readme_link_problems(text: str) -> list[str]:
    """What is wrong with the links of the API section of the README ``text``: a `name` link
    that does not land on the object's definition (a missing file, a line ``L<n>`` that is not
    that ``def`` / ``class``, another line than the definition's), a public name without one."""
    import rlops

    start, end = api_section(text)
    section = text[start:end]
    bad = []
    for m in LINK.finditer(section):
        name, target = m.group("name"), m.group("target")
        try:
            expected = source_target(resolve(name))
        except (AttributeError, ImportError, TypeError) as e:
            bad.append(f"{name}: not an rlops object with a source file ({e})")
            continue
        file, _, anchor = target.partition("#")
        if not (ROOT / file).is_file():
            bad.append(f"{name} -> {target}: no such file")
        elif anchor:
            n = int(anchor[1:]) if re.fullmatch(r"L\d+", anchor) else 0
            lines = (ROOT / file).read_text(encoding="utf-8").splitlines()
            short = name.rpartition(".")[2]
            here = lines[n - 1] if 0 < n <= len(lines) else ""
            if not re.match(rf"\s*(?:async\s+def|def|class)\s+{short}\b", here):
                bad.append(f"{name} -> {target}: line {anchor} is {here.strip()[:60]!r}")
        if target != expected:
            bad.append(f"{name} -> {target}: its definition is {expected}")
    linked = {m.group("name") for m in LINK.finditer(section)}
    bad += [
        f"{name}: no [`{name}`](...) link in the README's {SECTION!r}"
        for name in rlops.__all__
        if name not in linked
    ]
    return bad


def test_readme_links_each_public_name_to_its_definition():
    """Every name of rlops.__all__ has a row of the README's API table, linked to the line of
    its definition, and every `name` link of the section lands on its object's definition."""
    bad = readme_link_problems(README.read_text(encoding="utf-8"))
    assert not bad, (
        "\n".join(bad) + "\nfix: python tests/docs/test_rendered_reference.py --write-readme"
    )


def test_the_readme_link_check():
    """The check finds a link to a missing file, to a line that is not the definition, to the
    directive-only reference page, and a public name without a link; it passes on the README
    the writer produces."""
    fixed = write_readme_links(README.read_text(encoding="utf-8"))
    assert readme_link_problems(fixed) == []
    gae = source_target(resolve("gae"))
    path, _, line = gae.partition("#L")
    for broken in (
        fixed.replace(f"({gae})", f"({path}#L{int(line) + 1})"),  # the line after the def
        fixed.replace(f"({gae})", "(src/rlops/no_such_module.py#L1)"),
        fixed.replace(f"({gae})", "(docs/reference/advantages.md#rlops.no_such_anchor)"),
        fixed.replace(f"[`gae`]({gae})", "`gae`"),
    ):
        assert broken != fixed
        problems = readme_link_problems(broken)
        assert problems and all(p.startswith("gae") for p in problems), problems


def write_readme_links(text: str) -> str:
    """``text`` with each `name` link of the API section pointing at its definition."""
    start, end = api_section(text)

    def repl(m: re.Match) -> str:
        name = m.group("name")
        return f"[`{name}`]({source_target(resolve(name))})"

    return text[:start] + LINK.sub(repl, text[start:end]) + text[end:]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-readme"]:
        sys.exit("usage: python tests/docs/test_rendered_reference.py --write-readme")
    old = README.read_text(encoding="utf-8")
    new = write_readme_links(old)
    README.write_text(new, encoding="utf-8")
    changed = sum(a != b for a, b in zip(old.splitlines(), new.splitlines()))
    print(f"README.md: {changed} line(s) of {SECTION!r} rewritten")
