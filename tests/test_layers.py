"""The package's layers: each imports only from layers below it, and no modules import each other in a cycle.

compiler -> ops -> comm -> kernels -> blockend -> select -> targets (``_stats`` is below all of them). The
benchmarks, models, demo and testing helpers sit on top and may import anything. Imports inside functions
count like the others: an import put in a function to break a loop is still a loop.
"""

import ast
import functools
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
LAYERS = ["_stats", "targets", "select", "blockend", "kernels", "comm", "ops", "compiler"]  # lowest first


@functools.cache  # every _imports call asks for it
def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (SRC / "tpfuse").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, top_level_only: bool) -> set[str]:
    """tpfuse modules ``name`` imports (``from tpfuse import select`` counts as tpfuse.select)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up node.level - 1 packages from this module's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + [base]).strip(".")
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    modules = _modules()
    return {m for m in found if m in modules and m != name and m != "tpfuse"}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_only_downwards():
    upward = []
    for name, path in _modules().items():
        own = _layer(name)
        if own is None:
            continue
        for imported in _imports(name, path, top_level_only=False):
            theirs = _layer(imported)
            if theirs is None or theirs > own:
                upward.append(f"{name} imports {imported}")
    assert not upward, upward


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _import_graph() -> dict[str, set[str]]:
    """module -> the tpfuse modules it imports anywhere in its body (functions included)."""
    graph = {}
    for name, path in _modules().items():
        imported = _imports(name, path, top_level_only=False)
        if path.name == "__init__.py":  # a package importing its own modules is not a cycle with them
            imported = {m for m in imported if not m.startswith(name + ".")}
        graph[name] = imported
    return graph


def test_no_import_cycle():
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "modules that import each other in a loop: " + " -> ".join(cycle)


def test_the_block_end_needs_no_triton():
    """``tpfuse.blockend`` is what the ops, the compiler and the reference path read where Triton is
    missing."""
    for name, path in _modules().items():
        if name.startswith("tpfuse.blockend"):
            imported = {n.split(".")[0] for n in _raw_imports(path)}
            assert "triton" not in imported, f"{name} imports Triton"


def _raw_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module)
    return found
