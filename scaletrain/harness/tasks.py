"""--lm_eval_tasks looked up before training: lm-eval installed, each name known to lm-eval's TaskManager (or a task
YAML file, or a folder of them, as lm_eval's --include_path and --tasks take them), each task built (its dataset
loaded: from the local cache when offline) and holding a document for every rank that splits it. A mistake here is
one line naming the task, exit 2, before the model is built."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.errors import UsageError

log = logging.getLogger(__name__)

INSTALL_COMMAND = "pip install -r requirements-eval.txt"
OFFLINE_HINT = (
    'its dataset is not in the local cache: load it once online (python -c "import lm_eval.tasks as t; '
    "t.TaskManager().load(['{task}'])\"), then run offline"
)


@dataclass(frozen=True)
class HarnessTasks:
    """The tasks to score, as lm-eval loads them, and the TaskManager that knows them (its index only: each
    evaluation builds the tasks afresh, so that every one samples its few-shot examples as the first did)."""

    specs: tuple  # what lm-eval's TaskManager.load takes: registered names, or YAML file paths
    manager: object = field(repr=False)  # lm_eval.tasks.TaskManager
    documents: dict = field(default_factory=dict)  # leaf task -> documents scored (after --lm_eval_limit)


def require_lm_eval(flag: str) -> None:
    """UsageError naming the install command where lm-evaluation-harness is missing."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as err:
        raise UsageError(
            f"{flag}: lm-evaluation-harness is not installed ({err})", f"install it: {INSTALL_COMMAND}"
        ) from None


def resolve_tasks(
    specs: tuple, limit: int | None = None, ranks: int = 1, flag: str = "--lm_eval_tasks"
) -> HarnessTasks:
    """Each spec as lm-eval reads it: a folder adds itself to the include path and contributes its *.yaml files (its
    own, not its subfolders'); a YAML file is loaded by path; anything else is a registered task, group or tag name.
    Every task is built once here (UsageError naming it where it cannot be)."""
    require_lm_eval(flag)
    from lm_eval.tasks import TaskManager

    include, loads = [], []
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            yamls = sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml"))
            if not yamls:
                raise UsageError(f"{flag}: {spec} is a folder without task YAML files", "give a folder of *.yaml tasks")
            include.append(str(path.resolve()))
            loads += [str(y.resolve()) for y in yamls]
        elif path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise UsageError(f"{flag}: {spec}: no such task file", "give the path of a task YAML file")
            loads.append(str(path.resolve()))  # by path: its folder is not scanned (it may be any folder)
        else:
            loads.append(spec)
    has_names = any(Path(s).suffix not in (".yaml", ".yml") for s in loads)
    # The built-in index (about 14k YAML files, ~10 s) only where a spec is a name; a file's own folder otherwise.
    manager = TaskManager(include_path=include or None, include_defaults=has_names)
    documents: dict[str, int] = {}
    for spec in loads:
        documents |= _build(manager, spec=spec, limit=limit, ranks=ranks, flag=flag)
    return HarnessTasks(tuple(loads), manager, documents)


def _build(manager, *, spec: str, limit: int | None, ranks: int, flag: str) -> dict[str, int]:
    """{leaf task: documents scored} of one spec, built as an evaluation will build it."""
    shown = Path(spec).name if Path(spec).suffix in (".yaml", ".yml") else spec
    if Path(spec).suffix not in (".yaml", ".yml") and spec not in manager.all_tasks:
        import difflib

        close = difflib.get_close_matches(spec, manager.all_tasks, n=3)
        raise UsageError(
            f"{flag}: {spec!r} is not a task, group or tag lm-eval knows",
            f"did you mean {', '.join(close)}?" if close else "see `lm-eval ls tasks`, or give a task YAML path",
        )
    try:
        loaded = manager.load([spec])
    except Exception as err:  # a YAML that does not parse, an unknown key, a dataset that cannot be loaded
        raise UsageError(f"{flag}: task {shown}: {_reason(err)}", _hint(err, spec)) from None
    counts = {}
    for name, task in loaded["tasks"].items():
        docs = task.eval_docs
        count = len(docs) if limit is None else min(limit, len(docs))
        if count < ranks:
            raise UsageError(
                f"{flag}: task {name} scores {count} document(s), fewer than the {ranks} ranks that split them",
                "raise --lm_eval_limit, or score it after the run with scripts/evaluate.py on fewer ranks",
            )
        counts[name] = count
    return counts


def _reason(err: Exception) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:300]}"


def _hint(err: Exception, task: str) -> str:
    text = str(err).lower()
    if "offline" in text or "connection" in text or "couldn't reach" in text or "not found" in text:
        return OFFLINE_HINT.format(task=task)
    if "yaml" in text or "mapping" in text or isinstance(err, (TypeError, KeyError)):
        return "fix the task file (lm-eval's task guide: docs/task_guide.md)"
    return "fix the task or its dataset, or drop it from --lm_eval_tasks"
