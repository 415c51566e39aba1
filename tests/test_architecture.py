"""The package's import graph: no module inside harness/ takes part in an import cycle.

Every `import` and `from ... import` statement counts, including those inside functions (a lazy import that
dodges a cycle at import time still ties the two modules together for a reader). Imports under
`if TYPE_CHECKING:` are left out: they exist for annotations only and never run. Inside harness/mixers no module
imports another inside a function at all: the mixers, their kernels and their recurrences import in one direction.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the harness package."""
    files = {}
    for path in sorted((root / "harness").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement of a module, outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        stack.extend(children)


def _imported_names(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    # `from harness.mixers import kda` imports the submodule; `from harness.mixers import MIXERS` the package
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def _owning_module(name: str, known: set[str]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _function_level(tree: ast.AST) -> set[int]:
    """The ids of the import statements that sit inside a function."""
    return {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}


def import_graph(root: Path = ROOT, *, lazy_only: bool = False) -> dict[str, set[str]]:
    """Module -> the harness modules it imports (with lazy_only: those it imports inside a function)."""
    files = module_files(root)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        lazy = _function_level(tree) if lazy_only else None
        deps = set()
        for node in _import_nodes(tree):
            if lazy is not None and id(node) not in lazy:
                continue
            for name in _imported_names(module, path, node, known):
                owner = _owning_module(name, known)
                if owner and owner != module:
                    deps.add(owner)
        graph[module] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, deps = work[-1]
            for dep in deps:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph[dep]))))
                    break
                if dep in on_stack:
                    low[node] = min(low[node], index[dep])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_the_harness_package_has_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles inside harness/: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_of_harness_mixers_imports_another_inside_a_function():
    mixers = "harness.mixers"
    inside = {m: sorted(d for d in deps if d == mixers or d.startswith(mixers + "."))
              for m, deps in import_graph(lazy_only=True).items() if m.startswith(mixers + ".")}
    assert {m: d for m, d in inside.items() if d} == {}


def test_flops_and_observe_do_not_import_each_other_not_even_for_annotations():
    """harness.flops computes FLOP figures; harness.observe (setup_mfu) hands them to a stage's logger. Only observe
    imports flops: every import statement of flops counts here, those under TYPE_CHECKING and in functions too."""
    tree = ast.parse((ROOT / "harness" / "flops.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [f"{node.module}.{alias.name}" if node.module else f"(relative).{alias.name}"
                 for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names]
    assert [name for name in imported if "observe" in name or name.startswith("(relative)")] == []
    assert "harness.flops" in import_graph()["harness.observe"]


LOOP_MODULES = ("harness/engine.py", "harness/plain_engine.py", "harness/train/*.py", "harness/stages/*.py")


def test_the_engines_the_loop_and_the_stages_stay_under_800_lines():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for pattern in LOOP_MODULES for path in ROOT.glob(pattern)}
    assert len(lengths) >= 8 and {path: n for path, n in lengths.items() if n > 800} == {}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walk_finds_a_cycle_through_a_lazy_import(tmp_path):
    _write(tmp_path, {
        "harness/__init__.py": "",
        "harness/a.py": "from harness.b import f\n",
        "harness/b.py": "def f():\n    from harness import a\n",
        "harness/c.py": "from . import a\n",
    })
    assert import_cycles(import_graph(tmp_path)) == [["harness.a", "harness.b"]]
    assert import_graph(tmp_path, lazy_only=True) == {"harness": set(), "harness.a": set(), "harness.b": {"harness.a"},
                                                      "harness.c": set()}


def test_the_walk_leaves_out_type_checking_imports(tmp_path):
    _write(tmp_path, {
        "harness/__init__.py": "",
        "harness/a.py": "from harness.b import f\n",
        "harness/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.a import g\n",
    })
    graph = import_graph(tmp_path)
    assert graph["harness.b"] == set() and graph["harness.a"] == {"harness.b"}
    assert import_cycles(graph) == []


@pytest.mark.parametrize("chain", [2, 3])
def test_the_walk_finds_longer_cycles_and_relative_imports(tmp_path, chain):
    files = {"harness/__init__.py": "", "harness/pkg/__init__.py": "from .m0 import x\n"}
    for i in range(chain):
        files[f"harness/pkg/m{i}.py"] = f"from .m{(i + 1) % chain} import x\nx = 1\n"
    _write(tmp_path, files)
    assert import_cycles(import_graph(tmp_path)) == [[f"harness.pkg.m{i}" for i in range(chain)]]


def _top_level_names(path: Path) -> list[str]:
    """The public names a module defines at its top level (classes, functions, assigned constants), not those it
    imports."""
    names = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def test_harness_config_reexports_every_public_name_of_its_modules():
    """Callers import from `harness.config` alone: every public name that a module of the package defines is a name
    of the package (the same object) and listed in its __all__."""
    import importlib

    import harness.config as package

    modules = {m: p for m, p in module_files().items() if m.startswith("harness.config.")}
    assert {"harness.config.fields", "harness.config.evaluation", "harness.config.loading"} <= set(modules)
    missing = []
    for module, path in modules.items():
        mod = importlib.import_module(module)
        for name in _top_level_names(path):
            if getattr(package, name, None) is not getattr(mod, name) or name not in package.__all__:
                missing.append(f"{module}.{name}")
    assert missing == []


MAX_LINES = 800  # the project's limit per module


def test_no_module_of_harness_is_longer_than_the_limit():
    long = {module: lines for module, path in module_files().items()
            if (lines := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
