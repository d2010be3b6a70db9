"""The values of flags that say more than one thing: data file lists and globs, named validation sets, a dataset mix,
and the value checks the slices share (paths that must exist, counts that must not be negative).

Pure Python: no numpy, no torch.
"""

from __future__ import annotations

import difflib
import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path

from scaletrain.errors import UsageError

LR_SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup", "wsd")
# Hugging Face's (and TRL's) names for schedules that are ours, and the closest of ours to those that are not.
HF_LR_SCHEDULES = {"warmup_stable_decay": "wsd", "cosine_with_min_lr": "cosine", "cosine_warmup_with_min_lr": "cosine"}
CLOSEST_LR_SCHEDULE = {
    "cosine_with_restarts": "cosine (one decay, no restarts)",
    "polynomial": "linear (a polynomial of power 1; --min_lr_ratio sets the end)",
    "inverse_sqrt": "wsd (a stable phase, then a decay over --decay_ratio of the run)",
    "reduce_lr_on_plateau": "constant_with_warmup (no schedule here follows a metric)",
}


def lr_schedule_name(value: str) -> str:
    """--lr_scheduler_type: one of ours, or Hugging Face's name for one of ours (warmup_stable_decay is wsd,
    cosine_with_min_lr is cosine with --min_lr_ratio); any other name is refused with the closest of ours."""
    if value in LR_SCHEDULES:
        return value
    if value in HF_LR_SCHEDULES:
        return HF_LR_SCHEDULES[value]
    ours = ", ".join(LR_SCHEDULES)
    if value in CLOSEST_LR_SCHEDULE:
        raise UsageError(
            f"--lr_scheduler_type {value}: a Hugging Face schedule that is not one of ours ({ours})",
            f"the closest is {CLOSEST_LR_SCHEDULE[value]}",
        )
    close = difflib.get_close_matches(value, [*LR_SCHEDULES, *HF_LR_SCHEDULES], n=1)
    raise UsageError(
        f"--lr_scheduler_type {value}: not a schedule (ours: {ours}; also {', '.join(HF_LR_SCHEDULES)})",
        f"did you mean {close[0]}?" if close else "see train.py --help",
    )


LOCAL_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".parquet": "parquet"}


def parse_dataset_mix(value: str) -> list:
    """`path_a:0.7,path_b:0.3` -> [(path, weight)], weights normalised to sum to 1."""
    pairs = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        path, sep, weight = part.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not sep or not path or w <= 0:
            raise UsageError(
                f'--dataset_mix {value}: "{part}" is not path:weight with a positive weight',
                "write it as store_a:0.7,store_b:0.3",
            )
        pairs.append((path, w))
    if len(pairs) < 2:
        raise UsageError(f"--dataset_mix {value}: give at least two stores", "or use --data_path for one")
    total = sum(w for _, w in pairs)
    return [(path, w / total) for path, w in pairs]


def _check_not_negative(args, names: Sequence[str]) -> None:
    for name in names:
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} {getattr(args, name)}: must not be negative")


def _check_at_least_one(args, names: Sequence[str]) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)}: must be at least 1")


def _looks_local(path: str) -> bool:
    """A hub id is `name` or `org/name`; anything else (absolute, ./, ~, deeper folders, a file suffix) is local."""
    return (
        path.startswith(("/", ".", "~"))
        or path.count("/") > 1
        or Path(path).suffix in {".json", ".jsonl"}
        or Path(path).exists()
    )


def _check_model_path(flag: str, value: str | None) -> None:
    if value and _looks_local(value) and not Path(value).expanduser().exists():
        raise UsageError(f"--{flag} {value}: no such file or folder", "give a local model folder or a hub id")


def expand_data_files(value: str | None) -> list:
    """A --train_file/--validation_file value: one path, a glob, or several of either separated by commas."""
    if not value:
        return []
    files = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        expanded = os.path.expanduser(part)
        matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        files += matches or [part]
    return files


VALIDATION_SPLIT = "validation"
_SET_NAME = re.compile(r"^([A-Za-z0-9_]+)=(.+)$")


def parse_validation_sets(value: str | None) -> dict:
    """--validation_file as {store split: [files]}: plain paths make one set (split "validation", metric eval_loss);
    name=path items make one set each (split "validation.<name>", metric eval_<name>_loss)."""
    if not value:
        return {}
    parts = [p.strip() for p in value.split(",") if p.strip()]
    named = [_SET_NAME.match(p) for p in parts]
    if not any(named):
        return {VALIDATION_SPLIT: expand_data_files(value)}
    if not all(named):
        plain = next(p for p, m in zip(parts, named, strict=True) if not m)
        raise UsageError(
            f"--validation_file {value}: {plain} has no set name, the others do",
            "name every set (name=path; a glob such as name=dir/*.jsonl joins files into one set), or none",
        )
    sets = {}
    for match in named:
        assert match is not None  # all(named) above
        name, path = match.groups()
        split = f"{VALIDATION_SPLIT}.{name}"
        if split in sets:
            raise UsageError(
                f"--validation_file: the set {name} is named twice",
                f"give each set one entry (a glob such as {name}=dir/*.jsonl joins several files)",
            )
        sets[split] = expand_data_files(path)
    return sets


def eval_metric_prefix(split: str) -> str:
    """The metric names of a validation split's loss: eval_loss for the unnamed set, eval_<name>_loss for a named."""
    return "eval_" if split == VALIDATION_SPLIT else f"eval_{split.split('.', 1)[1]}_"


def eval_loss_set(metric: str) -> str | None:
    """The evaluation set whose loss a metric key is ("" for eval_loss, the name for eval_<name>_loss), or None for
    a key that is no evaluation loss: eval_metric_prefix read backwards."""
    if not (metric.startswith("eval_") and metric.endswith("loss")):
        return None
    return metric[len("eval_") : -len("loss")].rstrip("_")


def _check_data_files(flag: str, files: list) -> None:
    for file in files:
        path = Path(file)
        if glob.has_magic(file):
            raise UsageError(f"--{flag} {file}: the pattern matches no file", "check the glob")
        if not path.is_file():
            raise UsageError(f"--{flag} {file}: no such file", "give a local json, jsonl, csv, txt or parquet file")
        if path.suffix.lower() not in LOCAL_DATA_FORMATS:
            raise UsageError(
                f"--{flag} {file}: unsupported file type {path.suffix or '(none)'}",
                f"use one of {', '.join(sorted(LOCAL_DATA_FORMATS))}",
            )
        if not os.access(path, os.R_OK):
            raise UsageError(f"--{flag} {file}: file is not readable", "check its permissions")


def _check_data_sources(data) -> None:
    """The data sources of a DataArgs (data), checked: one source, files and folders that exist."""
    if data.dataset_name and data.train_file:
        raise UsageError("--dataset_name and --train_file: choose one data source")
    if data.validation_file and not (data.train_file or data.dataset_name):
        raise UsageError("--validation_file needs --train_file (or --dataset_name) too")
    _check_data_files("train_file", expand_data_files(data.train_file))
    _check_data_files("validation_file", [f for files in data.validation_sets.values() for f in files])
    if data.dataset_name and _looks_local(data.dataset_name) and not Path(data.dataset_name).expanduser().exists():
        raise UsageError(f"--dataset_name {data.dataset_name}: no such folder", "give a hub dataset name or a folder")
    if data.data_path and (data.train_file or data.dataset_name):
        raise UsageError(
            "--data_path and --train_file/--dataset_name: choose one data source",
            "--data_path is a store that data/prepare.py made; the others are raw data",
        )
    if data.dataset_mix and (data.data_path or data.train_file or data.dataset_name):
        raise UsageError(
            "--dataset_mix and another data source: choose one", "--dataset_mix already names every store the run reads"
        )
    for path, _ in data.mix:
        if not Path(path).is_dir():
            raise UsageError(f"--dataset_mix: {path} is not a folder", "give stores made by data/prepare.py")
    if data.data_path and not Path(data.data_path).is_dir():
        raise UsageError(f"--data_path {data.data_path}: no such folder", "prepare it with python data/prepare.py")
