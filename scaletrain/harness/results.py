"""What an lm-eval evaluation gives the run: each task's metrics as flat metric names (lm_eval/<task>/<metric>, the
stderr beside as lm_eval/<task>/<metric>_stderr), lm-eval's own results JSON, and a one-line summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

PREFIX = "lm_eval/"
RESULTS_DIR = "lm_eval"
STDERR = "_stderr"


def flatten(results: dict) -> dict:
    """{"lm_eval/<task>/<metric>": value} for every task and group of lm-eval's results, numbers only (a stderr lm-eval
    could not compute, "N/A", is left out). A metric under a filter other than lm-eval's "none" keeps the filter's
    name: lm_eval/gsm8k/exact_match_strict-match."""
    flat = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                metric, sep, filter_name = key.partition(",")
                if not sep or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if not math.isfinite(value):
                    continue
                stderr = metric.endswith(STDERR)
                base = metric.removesuffix(STDERR) if stderr else metric
                name = base if filter_name == "none" else f"{base}_{filter_name}"
                flat[f"{PREFIX}{task}/{name}{STDERR if stderr else ''}"] = float(value)
    return flat


def summary(flat: dict, step: int | None, seconds: float) -> str:
    """One line: each task's first metric (and its stderr), in the order lm-eval reported them."""
    shown, seen = [], set()
    for key, value in flat.items():
        task, metric = key.removeprefix(PREFIX).rsplit("/", 1)
        if metric.endswith(STDERR) or task in seen:
            continue
        seen.add(task)
        error = flat.get(f"{key}{STDERR}")
        shown.append(f"{task} {metric} {value:.4g}" + (f" ± {error:.2g}" if error is not None else ""))
    where = f"at step {step}" if step is not None else ""
    return f"lm-eval {where}: {', '.join(shown) or 'no metrics'} ({seconds:.1f} s)".replace("lm-eval :", "lm-eval:")


def write_results(folder: Path, name: str, results: dict) -> Path:
    """lm-eval's results JSON (as `lm_eval --output_path` writes it) in `folder`/lm_eval/`name`.json."""
    from lm_eval.utils import handle_non_serializable

    out = Path(folder) / RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    tmp.replace(path)
    return path


def write_samples(folder: Path, name: str, samples: dict) -> list:
    """Each task's samples (lm-eval's log_samples: the document, the requests' arguments, the responses, the filtered
    responses and the metrics of every item), one JSON line per item, in `folder`/lm_eval/`name`_samples_<task>.jsonl;
    the paths."""
    from lm_eval.utils import handle_non_serializable

    out = Path(folder) / RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for task, items in samples.items():
        path = out / f"{name}_samples_{task}.jsonl"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as handle:
            for item in sorted(items, key=lambda item: item.get("doc_id", 0)):
                handle.write(json.dumps(item, default=handle_non_serializable, ensure_ascii=False) + "\n")
        tmp.replace(path)
        paths.append(path)
    return paths


def is_lm_eval_metric(key: str) -> bool:
    return key.startswith(PREFIX)
