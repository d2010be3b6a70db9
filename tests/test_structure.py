"""The code's shape, checked: one wing (subpackage) per concern, each wing's face (its __init__.py) the only way in
from another wing, no import cycle between modules or between wings (function-level imports included; imports for
annotations only, under `if TYPE_CHECKING:`, never run and are not edges), no module over 600 lines, no function
over 80, and a config that a mistyped flag can reach without importing numpy or torch. The tests' own shape: a folder
per wing, each a package, no test module over 800 lines."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.harness import REPO

PACKAGE = REPO / "scaletrain"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
TESTS = REPO / "tests"
MAX_TEST_MODULE_LINES = 800


def modules() -> dict:
    """Every module of the package by dotted name below scaletrain: "run", "data.blocks", "data" (the face)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name:  # scaletrain/__init__.py itself holds nothing
            found[name] = ast.parse(path.read_text(), str(path))
    return found


def wing(module: str) -> str:
    """The wing a module belongs to ("data.blocks" -> "data"); a top-level module is a wing of its own."""
    return module.split(".")[0]


def type_checking_only(tree: ast.AST) -> set:
    """The import nodes under `if TYPE_CHECKING:`: annotations only, never run."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            guarded |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return guarded


def imports(tree: ast.AST, known: set, annotations: bool = False) -> set:
    """Every scaletrain module a module imports when it runs, at the top or inside a function (`annotations`: those
    it imports for annotations only, too). `from scaletrain.data import blocks` names a module;
    `from scaletrain.data import PackedBlocks` the face."""
    found = set()
    skipped = set() if annotations else type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("scaletrain.") for a in node.names if a.name.startswith("scaletrain.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "scaletrain" and not node.module.startswith("scaletrain."):
                continue
            base = node.module.removeprefix("scaletrain").removeprefix(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                found.add(sub if sub in known else base)
    return found - {""}


def import_graph(annotations: bool = False) -> dict:
    trees = modules()
    return {name: imports(tree, set(trees), annotations) - {name} for name, tree in trees.items()}


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


def test_the_import_scan_sees_modules_faces_and_lazy_imports():
    graph = import_graph()
    assert {"checkpoint", "preflight", "train"} <= graph["run"], "the scan misses the run's imports"
    assert "config" in graph["data.raw"] and "errors" in graph["config.checks"]
    assert "engine.ds_internals" in graph["engine.ops"], "a sibling imported as a module is that module"
    assert "engine" in graph["distributed.world"], "a lazy (function-level) import through a face is seen"


def test_no_import_cycle_between_modules_lazy_imports_included():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def wing_graph(annotations: bool = False) -> dict:
    wings: dict = {}
    for name, targets in import_graph(annotations).items():
        wings.setdefault(wing(name), set()).update(wing(t) for t in targets if wing(t) != wing(name))
    return wings


@pytest.mark.parametrize("annotations", [False, True], ids=["imports-that-run", "annotation-imports-counted"])
def test_no_import_cycle_between_wings(annotations):
    """The layering holds for the type checker too: an import made for annotations only is still a dependency."""
    wings = wing_graph(annotations)
    assert len(wings) >= 13, sorted(wings)  # 9 wings and the ground floor (run, preflight, launcher, errors, logs)
    cycle = find_cycle(wings)
    assert cycle is None, "wings import each other: " + " -> ".join(cycle)


def test_another_wing_is_entered_only_through_its_face():
    trees = modules()
    private = sorted(
        f"{name} imports scaletrain.{target}"
        for name, targets in import_graph(annotations=True).items()
        for target in targets
        if wing(target) != wing(name) and "." in target
    )
    assert not private, "import these from the wing's __init__.py instead: " + "; ".join(private)
    faces = [name for name in trees if "." not in name and (PACKAGE / name / "__init__.py").exists()]
    assert len(faces) == 9, faces


def test_each_face_exports_exactly_what_other_wings_import_from_it():
    trees = modules()
    faces = {name for name in trees if (PACKAGE / name / "__init__.py").exists()}
    used = {face: set() for face in faces}
    entrypoint = ast.parse((REPO / "train.py").read_text())  # train.py enters through the faces too
    for name, tree in [*trees.items(), ("train.py", entrypoint)]:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("scaletrain."):
                face = node.module.removeprefix("scaletrain.")
                if face in faces and wing(name) != face:
                    used[face] |= {a.name for a in node.names}
    for face in sorted(faces):
        exported = next(
            {elt.value for elt in node.value.elts}
            for node in trees[face].body
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
        )
        assert exported == used[face], (
            f"{face}/__init__.py: unused {exported - used[face]}, missing {used[face] - exported}"
        )


def test_the_scan_tells_annotation_imports_from_those_that_run():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scaletrain.data import X\n"
        "from scaletrain.errors import UsageError\n"
    )
    assert imports(tree, {"data", "errors"}) == {"errors"}
    assert imports(tree, {"data", "errors"}, annotations=True) == {"data", "errors"}


def test_the_typed_parts_name_no_wing_not_even_for_annotations():
    """scaletrain/parts.py is the ground floor: every wing may import it, so it names none of them; the run's plan,
    which names the wings' types, sits above them (scaletrain/plan.py) and no wing imports it."""
    assert import_graph(annotations=True)["parts"] == set()
    assert {"config", "data", "model", "observability"} <= import_graph(annotations=True)["plan"]
    importers = sorted(name for name, targets in import_graph(annotations=True).items() if "plan" in targets)
    assert importers == ["build", "preflight", "run"], importers


def test_no_module_in_the_package_is_longer_than_600_lines():
    long = sorted(
        f"{p.relative_to(PACKAGE)} ({n} lines)"
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert not long, "split these: " + "; ".join(long)


def test_no_test_module_is_longer_than_800_lines():
    long = sorted(
        f"{p.relative_to(TESTS)} ({n} lines)"
        for p in TESTS.rglob("test_*.py")
        if (n := len(p.read_text().splitlines())) > MAX_TEST_MODULE_LINES
    )
    assert not long, "split these: " + "; ".join(long)


def test_every_folder_of_test_modules_is_a_package():
    """tests/<wing>/test_x.py imports as tests.<wing>.test_x (pytest puts the repository, not the folder, on sys.path):
    a folder without __init__.py would go on sys.path itself, and tests/data/ or tests/scripts/ would then hide the
    repository's data/ and scripts/."""
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    assert not sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").is_file())


def test_no_function_in_the_package_is_longer_than_80_lines():
    long = [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "split these: " + "; ".join(long)


def test_at_most_ten_calls_in_the_package_pass_five_or_more_arguments_by_position():
    """Arguments after the first are keyword-only where a call would pass five or more; the calls left are to APIs
    positional by design (torch.autograd.Function.apply, the attention functions transformers calls)."""
    calls = [
        f"{name}:{node.lineno} {ast.unparse(node.func)}"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and sum(not isinstance(a, ast.Starred) for a in node.args) >= 5
    ]
    assert len(calls) <= 10, "pass keywords: " + "; ".join(calls)
    assert not [call for call in calls if " log." in call], "log lines are f-strings"


def test_importing_the_config_loads_neither_numpy_nor_torch_nor_the_writer_torch_dynamo():
    """The config is read before anything heavy; the checkpoint writer process (checkpoint/async_save.py, spawned at
    the first save) imports torch but not torch._dynamo (2.3 s more, on the path of the first commit) nor the
    libraries the ranks need."""
    heavy = ("numpy", "torch", "transformers", "deepspeed", "datasets")
    not_in_writer = ("torch._dynamo", "transformers", "deepspeed", "datasets", "peft")
    code = (
        "import sys; import scaletrain.config, scaletrain.errors; "
        f"print(','.join(m for m in {heavy} if m in sys.modules)); "
        "from scaletrain.checkpoint.async_save import writer_main; "
        f"print(','.join(m for m in {not_in_writer} if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    config_loaded, writer_loaded = proc.stdout.split("\n")[:2]
    assert config_loaded == "", f"importing scaletrain.config loaded {config_loaded}"
    assert writer_loaded == "", f"importing the checkpoint writer loaded {writer_loaded}"


def test_the_built_in_sample_with_its_store_ready_needs_no_import_of_datasets(tmp_path):
    """datasets (with pandas and pyarrow: about 1 s of every rank's start) is for reading raw data: the pre-flight of
    the built-in sample and the look at a complete token store do without it; a user's file is still read ahead."""
    code = (
        "import sys; from pathlib import Path; "
        "from scaletrain.config import DataArgs; from scaletrain.data.checks import check_data_source; "
        "from scaletrain.data.preparation import exclusive_preparation; "
        "from scaletrain.data.token_store import MANIFEST; "
        "assert check_data_source(DataArgs(), None, reads_first_row=True) is None; "
        "store = Path(sys.argv[1]); store.mkdir(); (store / MANIFEST).write_text('{}'); "
        "exclusive_preparation(store).__enter__(); print('datasets' in sys.modules); "
        "check_data_source(DataArgs(train_file=sys.argv[2]), None, reads_first_row=True); "
        "print('datasets' in sys.modules)"
    )
    sample = str(REPO / "data" / "sample" / "validation.jsonl")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store"), sample],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]
