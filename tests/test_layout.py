"""The house rules, checked: the stages form a one-way chain, the import graph has no cycle, and no
file or function in the packages outgrows what a reader can hold (600 lines, 100 lines).

The chain (a package may import from itself and from the packages before it, never after):

    eagle3  ->  data_gen  ->  serve_eval  ->  hard_mining  ->  recipes

``eagle3`` is the core (targets, capture, draft, TTT, trainer, store format, export, config);
``data_gen`` makes the data; ``serve_eval`` runs and measures drafts; ``hard_mining`` uses both;
``recipes`` drives everything. Inside ``eagle3`` its parts form a chain of their own:

    root (errors, settings, devices, atomic writes)  ->  target  ->  draft  ->  store  ->  export  ->  train
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ("eagle3", "data_gen", "serve_eval", "hard_mining", "recipes")
PARTS = ("root", "target", "draft", "store", "export", "train")
"""``eagle3``'s parts: its subpackages, ``eagle3.export`` (one module), and the root's modules."""
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, Path]:
    out = {}
    for package in CHAIN:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def module_edges(source: str, name: str, modules: dict[str, Path], filename: str = "<source>") -> dict[str, int]:
    """{imported project module: line} of one module's source: function-local imports and those under
    ``if TYPE_CHECKING`` included (a type names a dependency all the same)."""
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(source, filename=filename)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.split(".")[0] in CHAIN:
                edges.setdefault(target, node.lineno)
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported project module: line} (:func:`module_edges`)."""
    modules = _modules()
    return {name: module_edges(path.read_text(), name, modules, str(path)) for name, path in modules.items()}


def part_of(module: str) -> str | None:
    """The ``eagle3`` part a module belongs to (None outside ``eagle3``)."""
    parts = module.split(".")
    if parts[0] != "eagle3":
        return None
    if len(parts) > 1 and parts[1] in PARTS:
        return parts[1]
    return "root"


def _against(graph: dict[str, dict[str, int]], order: tuple[str, ...], where, what: str) -> list[str]:
    """Edges whose target's place in ``order`` comes after its importer's (``where`` maps a module to
    its place, None for modules the order does not cover)."""
    rank = {p: i for i, p in enumerate(order)}
    paths = _modules()
    out = []
    for m, edges in graph.items():
        for t, line in edges.items():
            a, b = where(m), where(t)
            if a is None or b is None or rank[b] <= rank[a]:
                continue
            at = f"{paths[m].relative_to(ROOT)}:{line}" if m in paths else m
            out.append(f"{at}: {m} imports {t} ({what} {b} comes after {a} in {' -> '.join(order)})")
    return out


def chain_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports against the package chain, and inside ``eagle3`` against its parts' chain."""
    return (_against(graph, CHAIN, lambda m: m.split(".")[0] if m.split(".")[0] in CHAIN else None, "package")
            + _against(graph, PARTS, part_of, "part"))


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def oversized() -> list[str]:
    out = []
    for path in _modules().values():
        text = path.read_text()
        lines = text.count("\n")
        rel = path.relative_to(ROOT)
        if lines > MAX_FILE_LINES:
            out.append(f"{rel}: {lines} lines (> {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{rel}:{node.lineno}: {node.name} is {length} lines (> {MAX_FUNCTION_LINES})")
    return out


def test_imports_follow_the_chain() -> None:
    bad = chain_violations(import_graph())
    assert not bad, "imports against the chain:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_files_and_functions_stay_readable() -> None:
    bad = oversized()
    assert not bad, "over the size limits:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_are_for() -> None:
    """The checkers themselves, on a made-up graph: a core module importing a stage, a part of the
    core importing a later part, and a cycle."""
    graph = {"eagle3.draft.model": {"serve_eval.verify": 3}, "serve_eval.verify": {"eagle3.draft.model": 1},
             "serve_eval.evaluate": {"eagle3.draft.model": 2}, "eagle3.target.model": {"eagle3.store.shards": 4},
             "eagle3.train.loop": {"eagle3.export": 5, "eagle3.errors": 6}, "eagle3.errors": {}}
    assert cycles(graph) == [["eagle3.draft.model", "serve_eval.verify"]]
    assert cycles({"a.x": {"a.y": 1}, "a.y": {}}) == []
    bad = chain_violations(graph)
    assert len(bad) == 2, bad
    # an import for types only is a dependency too: the draft layer naming the trainer's settings
    modules = _modules()
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eagle3.train.config import TrainConfig\n"
    edges = module_edges(typed, "eagle3.draft.families.base", modules)
    assert edges == {"eagle3.train.config": 3}
    (only,) = chain_violations({"eagle3.draft.families.base": edges})
    assert "part train comes after draft" in only
    assert "eagle3.draft.model imports serve_eval.verify (package serve_eval comes after eagle3" in bad[0]
    assert "eagle3.target.model imports eagle3.store.shards (part store comes after target" in bad[1]
    assert [part_of(m) for m in ("eagle3.errors", "eagle3.export", "eagle3.draft.families.base", "data_gen.x")] == [
        "root", "export", "draft", None]


def test_tests_share_builders_through_the_helpers_module_only() -> None:
    """A test module imports shared builders from tests/helpers.py (or the fake device), never from
    another test module or from conftest."""
    allowed = {"tests.helpers", "tests.fake_device"}
    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                if node.module not in allowed:
                    bad.append(f"tests/{path.name}:{node.lineno}: from {node.module} import ...")
    assert not bad, "\n".join(bad)


def borrowed_imports(source: str) -> list[str]:
    """What a tool, benchmark or script takes from outside the product: an import of the tests or a
    path put on ``sys.path`` (each a line)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
            out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tests" for a in node.names):
            out.append("import tests")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("insert", "append") and ast.unparse(node.func.value) == "sys.path"):
            out.append(ast.unparse(node))
    return out


def test_tools_benchmarks_and_scripts_import_the_product_only() -> None:
    found = {str(p.relative_to(ROOT)): borrowed_imports(p.read_text(encoding="utf-8"))
             for folder in ("bench", "scripts", "tools") for p in sorted((ROOT / folder).rglob("*.py"))}
    assert not {k: v for k, v in found.items() if v}
    # the negative control: each kind is caught
    bad = "import sys\nsys.path.insert(0, 'x')\nfrom tests.helpers import a\nimport tests\n"
    assert sorted(borrowed_imports(bad)) == ["from tests.helpers import ...", "import tests", "sys.path.insert(0, 'x')"]
