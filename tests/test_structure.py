"""The code's shape, checked: no import cycle inside scaletrain/ (function-level imports included), no function over
80 lines, and a config module that a mistyped flag can reach without importing numpy or torch."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import REPO

PACKAGE = REPO / "scaletrain"
MAX_FUNCTION_LINES = 80


def modules() -> dict:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def imported_modules(tree: ast.AST, known: set) -> set:
    """scaletrain modules a module imports anywhere in it, at the top or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("scaletrain.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "scaletrain":  # from scaletrain import checkpoint, model
                found |= {a.name for a in node.names if a.name in known}
            elif node.module.startswith("scaletrain."):
                found.add(node.module.split(".")[1])
    return found


def find_cycle(graph: dict):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_inside_the_package_lazy_imports_included():
    trees = modules()
    graph = {name: imported_modules(tree, set(trees)) - {name} for name, tree in trees.items()}
    assert graph["run"] >= {"checkpoint", "preflight", "loop"}, "the import scan misses imports"
    assert "config" in graph["raw_data"] and "errors" in graph["config"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_function_in_the_package_is_longer_than_80_lines():
    long = [
        f"{name}.py:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "split these: " + "; ".join(long)


def test_importing_the_config_loads_neither_numpy_nor_torch():
    heavy = ("numpy", "torch", "transformers", "deepspeed", "datasets")
    code = (
        "import sys; import scaletrain.config.core, scaletrain.errors; "
        f"print(','.join(m for m in {heavy} if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"importing scaletrain.config.core loaded {proc.stdout.strip()}"
