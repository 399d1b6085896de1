"""The import graph of ``src/rlops`` points down only, has no cycle, and no module reaches into
another module's private names. Layers (a module may import its own package and lower layers):

    0  _checks, _threads, _backends, _types, _numerics, _triton   (argument checks; the CPU
                                              thread pool; backends; types; shared Triton code)
    1  scan, distributed                      (the bare recurrence; layout and group helpers)
    2  stats, logprobs                        (leaves)
    3  advantages, losses, corrections        (estimators; losses and KL controllers; rollout
                                              correction and selection masks)
    3.5  kl_controllers, selection, rollout_correction, group_advantages   (kept import
                                              paths: thin re-exports of the packages above)
    4  rlops (the package: the public API)
    5  compat, measure, testing               (adapt, measure or check against the core)
    6  cli                                    (the command line, on the measurement harness)

Parsed statically with ``ast``, including imports inside functions (lazy imports count). The
scripts in ``benchmarks/`` use the harness, never the command line's modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "rlops"
BENCHMARKS = SRC.parents[1] / "benchmarks"

LAYERS = {
    "rlops._checks": 0,
    "rlops._threads": 0,
    "rlops._backends": 0,
    "rlops._types": 0,
    "rlops._numerics": 0,
    "rlops._triton": 0,
    "rlops.scan": 1,
    "rlops.distributed": 1,
    "rlops.stats": 2,
    "rlops.logprobs": 2,
    "rlops.advantages": 3,
    "rlops.losses": 3,
    "rlops.distillation": 3,  # on the log-prob ops' layout and the group call
    "rlops.corrections": 3,  # rollout correction and selection masks
    "rlops.kl_controllers": 3.5,  # the kept import paths: re-exports only
    "rlops.selection": 3.5,
    "rlops.rollout_correction": 3.5,
    "rlops.group_advantages": 3.5,
    "rlops": 4,
    "rlops.compat": 5,
    "rlops.measure": 5,
    "rlops.testing": 5,  # the contract: the core's references turned into checks
    "rlops.cli": 6,
}


def _module_name(path: pathlib.Path) -> str:
    parts = ["rlops", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The layer unit a module belongs to: its top-level package under rlops (or rlops)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else "rlops"


def _imports(path: pathlib.Path, module: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("rlops")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("rlops"):
                out.append((target, [a.name for a in node.names], node.lineno))
    return out


def _all_modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


MODULES = _all_modules()


def _resolve(target: str, names: list[str]) -> list[str]:
    """The rlops modules an import statement loads (``from pkg import sub`` loads pkg.sub)."""
    found = [target] if target in MODULES else []
    found += [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
    return found or [target]


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if _unit(m) not in LAYERS)
    assert not missing, f"modules outside every layer (add them to LAYERS): {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    unit = _unit(module)
    bad = []
    for target, names, line in _imports(MODULES[module], module):
        for dep in _resolve(target, names):
            dep_unit = _unit(dep)
            if dep_unit == unit and unit != "rlops":
                continue  # inside one package
            if dep == "rlops" and unit == "rlops":
                continue
            if LAYERS[dep_unit] >= LAYERS[unit]:
                bad.append(f"line {line}: {dep} (layer {LAYERS[dep_unit]})")
    assert not bad, f"{module} (layer {LAYERS[unit]}) imports from its layer or above: {bad}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    """Private names (``_x``) are imported only from the module's own package, and a private
    module only by modules of the package that holds it (``rlops._checks``, the one validation
    library, is held by ``rlops`` itself and so serves every module)."""
    unit = _unit(module)
    bad = []
    for target, names, line in _imports(MODULES[module], module):
        same_package = _unit(target) == unit and unit != "rlops"
        parts = target.split(".")
        for i, part in enumerate(parts[1:], start=1):
            holder = ".".join(parts[:i])
            if part.startswith("_") and not (module + ".").startswith(holder + "."):
                bad.append(f"line {line}: private module {target}")
        for n in names:
            dunder = n.startswith("__") and n.endswith("__")  # ``__all__`` of a re-export
            if n.startswith("_") and not dunder and not same_package:
                bad.append(f"line {line}: {target}.{n}")
    assert not bad, f"{module} reaches into private names: {bad}"


def _cycle_edges(module: str, path: pathlib.Path) -> set[str]:
    """The modules ``module`` needs loaded. ``from pkg import sub`` of a submodule needs only
    ``pkg.sub`` (Python loads the parents first anyway); a name that the package itself
    defines (``from rlops.scan import SCAN`` inside ``rlops.scan._op``) needs the package, and
    is an edge like any other, so a child that reads its parent's names while the parent
    imports the child is a cycle."""
    deps = set()
    for target, names, _ in _imports(path, module):
        subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
        deps.update(subs)
        if target in MODULES and (len(subs) < len(names) or not names):
            deps.add(target)
    ancestors = {a for a in MODULES if module.startswith(a + ".")}
    # a bare ancestor edge with no names read from it is Python's own parent import
    return deps - {module} - {a for a in ancestors if a not in _names_read(path, module, a)}


def _names_read(path: pathlib.Path, module: str, package: str) -> set[str]:
    """``{package}`` when ``module`` imports a name from ``package`` that is not a
    submodule."""
    for target, names, _ in _imports(path, module):
        if target == package and any(f"{target}.{n}" not in MODULES for n in names):
            return {package}
    return set()


def test_no_import_cycle():
    graph = {m: _cycle_edges(m, p) for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d) :], d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_scan_knows_nothing_of_rl_or_distribution():
    for m, p in MODULES.items():
        if _unit(m) != "rlops.scan":
            continue
        deps = {d for t, names, _ in _imports(p, m) for d in _resolve(t, names)}
        outside = {
            d
            for d in deps
            if _unit(d)
            not in (
                "rlops.scan",
                "rlops._checks",
                "rlops._threads",
                "rlops._backends",
                "rlops._triton",
            )
        }
        assert not outside, f"{m} imports {sorted(outside)}"
        assert "torch.distributed" not in p.read_text(), f"{m} uses torch.distributed"


LOGPROBS = SRC / "logprobs"
MAX_POSITIONAL = 6


def test_log_prob_ops_share_the_engine_not_each_other():
    """``linear.py`` and ``fused.py`` are siblings on ``_engine``: the op on logits exports only
    itself, and the linear op takes no private name (nor any engine name) from it."""
    linear = _imports(LOGPROBS / "linear.py", "rlops.logprobs.linear")
    from_fused = [
        (names, line)
        for target, names, line in linear
        if target == "rlops.logprobs.fused" or "fused" in names
    ]
    assert not from_fused, f"logprobs/linear.py imports from fused.py: {from_fused}"
    tree = ast.parse((LOGPROBS / "fused.py").read_text())
    exported = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    assert exported == [["logprobs_and_entropy"]], exported


def _triton_kernel(node: ast.AST) -> bool:
    """Whether ``node`` is a function decorated with ``triton.jit`` (``@triton.jit`` or
    ``@triton.jit(...)``)."""
    for dec in getattr(node, "decorator_list", ()):
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            if isinstance(target.value, ast.Name) and target.value.id == "triton":
                return True
    return False


def test_log_prob_functions_take_few_positional_parameters():
    """No function in ``src/rlops/logprobs`` takes more than 6 positional parameters: calls
    pass keywords or the frozen plan, never long positional lists.

    Triton kernels (functions decorated with ``triton.jit``) are exempt: their parameters are
    the launch ABI (pointers, sizes, strides, then ``tl.constexpr`` flags), bound by position
    at the launch and in the compiled signature; Triton cannot take a plan object or
    keyword-only parameters there. Their host-side launchers obey the rule."""
    wide = []
    for path in sorted(LOGPROBS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if _triton_kernel(node):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                n = len(args.posonlyargs) + len(args.args) + (args.vararg is not None)
                if n > MAX_POSITIONAL:
                    name = getattr(node, "name", "<lambda>")
                    wide.append(f"{path.name}:{node.lineno} {name} ({n})")
    assert not wide, f"functions with more than {MAX_POSITIONAL} positional parameters: {wide}"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_benchmarks_use_the_harness_not_the_command_line(script):
    """``benchmarks/`` imports the measurement harness (``rlops.measure``) and the public API,
    no module of ``rlops.cli`` and no private name."""
    path = BENCHMARKS / script
    bad = [
        f"line {line}: {target}" + (f" ({', '.join(names)})" if names else "")
        for target, names, line in _imports(path, "benchmarks." + path.stem)
        if target == "rlops.cli"
        or target.startswith("rlops.cli.")
        or any(part.startswith("_") for part in target.split("."))
        or any(n.startswith("_") for n in names)
    ]
    assert not bad, f"benchmarks/{script} imports the command line or private names: {bad}"


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain (empty for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_process_wide_backend_flag_is_written(module):
    """No ``torch.backends...`` assignment (or ``setattr`` on it) anywhere in ``src/``: a flag
    flipped around a call races with every other thread of the process."""
    bad = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and _dotted(node.func) == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if _dotted(el).startswith(("torch.backends", "backends.")):
                    bad.append(f"line {node.lineno}: {_dotted(el)}")
    assert not bad, f"{module} writes process-wide backend flags: {bad}"
