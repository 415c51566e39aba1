"""The modules of harness/mixers import each other in one direction: every `import` / `from` statement between
them, at module level or inside a function, read from the source, forms an acyclic graph, and none sits inside a
function (a function-level import between them would only hide a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

MIXERS_DIR = Path(__file__).resolve().parents[1] / "harness" / "mixers"
PACKAGE = "harness.mixers"
MODULES = {p.stem for p in MIXERS_DIR.glob("*.py")}


def _targets(node: ast.AST) -> list[str]:
    """The harness.mixers modules an import statement loads ('__init__' for the package's own names)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [n.split(".")[2] for n in names if n.startswith(PACKAGE + ".")]
    if not isinstance(node, ast.ImportFrom) or node.module is None or node.level:
        return []
    if node.module == PACKAGE:
        return [a.name if a.name in MODULES else "__init__" for a in node.names]
    if node.module.startswith(PACKAGE + "."):
        return [node.module.split(".")[2]]
    return []


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside a function or class) by the file at path."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {t for node in tree.body for t in _targets(node)}
    everywhere = {t for node in ast.walk(tree) for t in _targets(node)}
    return top, everywhere - top


def _graph() -> dict[str, set[str]]:
    return {p.stem: set().union(*_imports(p)) for p in MIXERS_DIR.glob("*.py")}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a path [a, b, ..., a], or [] when it has none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return []


def test_the_walker_sees_every_form_of_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from harness.mixers.base import Mixer\nimport harness.mixers.ops\n"
                   "def f():\n    from harness.mixers import kernels, MIXERS\n")
    top, inside = _imports(src)
    assert top == {"base", "ops"} and inside == {"kernels", "__init__"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_module_of_harness_mixers_imports_another_inside_a_function():
    lazy = {p.stem: inside for p in MIXERS_DIR.glob("*.py") if (inside := _imports(p)[1])}
    assert lazy == {}


def test_the_import_graph_of_harness_mixers_is_acyclic():
    graph = _graph()
    assert {"base", "kernels", "recurrence", "ops", "dispatch", "kda"} <= set(graph)
    assert _cycle(graph) == []
