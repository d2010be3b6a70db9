"""Every flag of a run, parsed into one frozen RunConfig and checked before any heavy import.

This module imports no torch, deepspeed or transformers: a mistake in a flag must cost the user
a second, not the minute it takes to import the stack and build a process group.
Flag names follow Hugging Face's `run_clm.py` / `TrainingArguments` wherever one exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "data" / "tiny-llama"
DEFAULT_TRAIN_FILE = REPO_ROOT / "data" / "sample" / "train.jsonl"
DEFAULT_VALIDATION_FILE = REPO_ROOT / "data" / "sample" / "validation.jsonl"
DEFAULT_DS_CONFIG = "ds_configs/zero3.json"
NVME_PATH_ENV = "SCALETRAIN_NVME_PATH"

LR_SCHEDULES = ("cosine", "linear", "constant_with_warmup", "wsd")
REPORT_SINKS = ("none", "wandb", "tensorboard")
LOCAL_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".parquet": "parquet"}


class UsageError(Exception):
    """A user mistake: one line naming the flag, key or file, and an optional hint line. Exit code 2."""

    def __init__(self, message: str, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


def _flag(default, help: str, **argparse_kwargs):
    """A dataclass field that also carries its command-line help (one source for both)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass(frozen=True)
class RunConfig:
    # --- DeepSpeed
    config: str = _flag(DEFAULT_DS_CONFIG, "DeepSpeed JSON config; values set to \"auto\" are filled from these flags.")
    # --- model
    model_name_or_path: Optional[str] = _flag(None, "Pretrained model: hub id or local folder (from_pretrained).")
    config_name: Optional[str] = _flag(
        None, "Model config (hub id or local folder/file) to train from scratch. Default: data/tiny-llama.")
    tokenizer_name: Optional[str] = _flag(None, "Tokenizer (hub id or local folder). Default: the model's.")
    trust_remote_code: bool = _flag(False, "Allow model/tokenizer code from the hub to run. Off unless asked.")
    gradient_checkpointing: bool = _flag(False, "Recompute activations in backward to save memory.")
    # --- data
    dataset_name: Optional[str] = _flag(None, "Hugging Face dataset name (hub or a local dataset script/folder).")
    dataset_config_name: Optional[str] = _flag(None, "Configuration of --dataset_name.")
    train_file: Optional[str] = _flag(
        None, "Local training file(s): json, jsonl, csv, txt, parquet; a glob or a comma-separated list. "
        "Default: data/sample/train.jsonl.")
    validation_file: Optional[str] = _flag(None, "Local validation file(s), same formats as --train_file.")
    data_path: Optional[str] = _flag(None, "A token store made by data/prepare.py (instead of raw data).")
    dataset_mix: Optional[str] = _flag(
        None, "Several token stores mixed by weight: store_a:0.7,store_b:0.3 (deterministic, by --seed).")
    attention_isolation: bool = _flag(
        False, "No token attends across a document boundary (position ids restart per document).")
    validation_split_percentage: int = _flag(
        5, "When there is no validation file or split, hold out this percent of the training documents.")
    text_column: str = _flag("text", "Column that holds the text.")
    block_size: Optional[int] = _flag(
        None, "Tokens per training sequence. Default: min(1024, model's max positions).")
    preprocessing_num_workers: Optional[int] = _flag(None, "Processes for tokenization (default: the CPU count).")
    # --- batch and optimisation
    per_device_train_batch_size: int = _flag(8, "Sequences per rank per micro-batch.")
    per_device_eval_batch_size: int = _flag(8, "Sequences per rank per evaluation batch.")
    gradient_accumulation_steps: int = _flag(1, "Micro-batches accumulated per optimizer step.")
    learning_rate: float = _flag(1e-3, "Peak learning rate.")
    weight_decay: float = _flag(0.0, "AdamW weight decay.")
    adam_beta1: float = _flag(0.9, "AdamW beta1.")
    adam_beta2: float = _flag(0.95, "AdamW beta2.")
    adam_epsilon: float = _flag(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _flag(1.0, "Gradient clipping norm (0 disables).")
    lr_scheduler_type: str = _flag("cosine", "LR schedule after warmup.", choices=LR_SCHEDULES)
    warmup_steps: int = _flag(0, "Linear warmup steps (overrides --warmup_ratio when > 0).")
    warmup_ratio: float = _flag(0.05, "Warmup as a fraction of the total steps.")
    min_lr_ratio: float = _flag(0.1, "Final LR as a fraction of the peak (cosine, linear, wsd).")
    decay_ratio: float = _flag(0.2, "wsd: fraction of the total steps spent in the final decay.")
    max_steps: int = _flag(-1, "Optimizer steps to run; overrides --num_train_epochs when > 0.")
    num_train_epochs: float = _flag(3.0, "Epochs over the training blocks when --max_steps is not set.")
    seed: int = _flag(42, "Seed for initialisation and the data order.")
    bf16: bool = _flag(False, "Train in bf16 (overrides the JSON's \"auto\").")
    fp16: bool = _flag(False, "Train in fp16 with dynamic loss scaling (overrides the JSON's \"auto\").")
    nvme_path: Optional[str] = _flag(
        None, f"Folder for NVMe offload (zero3_nvme.json). Default: ${NVME_PATH_ENV}.")
    # --- outputs and logging
    output_dir: str = _flag("runs/default", "Run folder: checkpoints, exported model, metrics, resolved configs.")
    overwrite_output_dir: bool = _flag(False, "Allow a fresh run in a folder that holds a previous run.")
    logging_steps: int = _flag(10, "Log metrics every N optimizer steps.")
    eval_steps: int = _flag(0, "Evaluate every N optimizer steps (0: only at the end).")
    max_eval_samples: Optional[int] = _flag(None, "Cap on validation blocks per evaluation.")
    save_steps: int = _flag(0, "Save (and commit) a checkpoint every N steps (0: only at the end).")
    save_interval_minutes: float = _flag(0.0, "Also save when this many minutes passed since the last save (0: off).")
    save_total_limit: int = _flag(0, "Keep only the newest K committed checkpoints (0: keep all).")
    resume_from_checkpoint: str = _flag(
        "auto", "auto: newest committed checkpoint in --output_dir if any; none: start fresh; or a checkpoint path.")
    preemption_grace_seconds: float = _flag(
        120.0, "Seconds a scheduler allows between its signal and the kill; a slower save is warned about.")
    on_nonfinite: str = _flag(
        "skip", "A non-finite loss or gradient norm, or a loss spike: skip the update on every rank (and roll back "
        "after --max_consecutive_skips), or stop with a message.", choices=("skip", "stop"))
    max_consecutive_skips: int = _flag(
        5, "After this many skipped updates in a row, roll back to the last committed checkpoint and continue "
        "past the offending samples (0: never roll back).")
    loss_spike_factor: float = _flag(
        0.0, "Treat a step whose loss exceeds this multiple of the running mean loss like a non-finite one "
        "(0: off; e.g. 3).")
    export_hf_at_end: bool = _flag(
        True, "Write the Hugging Face model (safetensors, config, tokenizer) to --output_dir at the end; "
        "--no-export_hf_at_end skips it (scripts/export_hf.py can export any checkpoint later).")
    peak_tflops: Optional[float] = _flag(
        None, "Peak TFLOP/s of one device for MFU (default: a table for A100/H100/H200, a calibration on CPU).")
    report_to: str = _flag("none", "Extra metrics sinks, comma-separated: wandb, tensorboard (JSONL and console are "
                           "always on).")
    dry_run: bool = _flag(False, "Build everything, run one full step, report memory and step time, exit; "
                                 "nothing is saved.")
    profile_steps: Optional[str] = _flag(None, "A torch profiler trace of these steps (e.g. 5-7) in <output_dir>/profile.")
    run_name: Optional[str] = _flag(None, "Run name for wandb. Default: the output folder's name.")
    disable_tqdm: bool = _flag(False, "No progress bar.")
    print_config: bool = _flag(False, "Print the resolved run and DeepSpeed configs, with sources, and exit.")
    plan: bool = _flag(False, "Memory planner: per-GPU memory of each ZeRO stage and offload option for the model "
                              "(built on the meta device) on --num_nodes x --num_gpus GPUs, a recommendation, exit.")
    num_gpus: int = _flag(1, "--plan: GPUs per node.")
    num_nodes: int = _flag(1, "--plan: nodes.")
    gpu_memory_gb: float = _flag(80.0, "--plan: memory of one GPU, GB.")
    host_memory_gb: Optional[float] = _flag(None, "--plan: host memory per node for offload, GB (default: unchecked).")
    plan_precision: str = _flag("bf16", "--plan: training precision to plan for.", choices=("bf16", "fp16", "fp32"))
    local_rank: int = _flag(-1, "Set by the deepspeed launcher; leave it alone.")
    # Not a flag: the flags the user typed, so an explicit flag can be told apart from a default.
    explicit_flags: tuple = field(default=(), metadata={"internal": True})

    # --- derived views (no state of their own)
    @property
    def model_source(self) -> str:
        """Where the model architecture comes from: the pretrained folder/id or the config to train from."""
        return self.model_name_or_path or self.config_name or str(DEFAULT_MODEL_DIR)

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer_name or self.model_source

    @property
    def uses_default_data(self) -> bool:
        return (self.dataset_name is None and self.train_file is None and self.data_path is None
                and self.dataset_mix is None)

    @property
    def train_data_file(self) -> Optional[str]:
        return str(DEFAULT_TRAIN_FILE) if self.uses_default_data else self.train_file

    @property
    def validation_data_file(self) -> Optional[str]:
        return str(DEFAULT_VALIDATION_FILE) if self.uses_default_data else self.validation_file

    @property
    def report_sinks(self) -> tuple:
        return tuple(s.strip() for s in self.report_to.split(",") if s.strip() and s.strip() != "none")

    @property
    def profile_range(self) -> Optional[tuple]:
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition("-")
        return int(first), int(last or first)

    @property
    def resolved_nvme_path(self) -> Optional[str]:
        return self.nvme_path or os.environ.get(NVME_PATH_ENV) or None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, did-you-mean) instead of printing usage and exiting."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            unknown = message.split(":", 1)[1].split()
            flag = next((u for u in unknown if u.startswith("--")), unknown[0])
            name = flag.split("=", 1)[0]
            known = [opt for action in self._actions for opt in action.option_strings if opt.startswith("--")]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}?" if close else "see python train.py --help for the flags"
            raise UsageError(f"unknown flag {name}", hint)
        raise UsageError(message, "see python train.py --help")


def flag_fields() -> list:
    return [f for f in dataclasses.fields(RunConfig) if not f.metadata.get("internal")]


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The CLI, generated from RunConfig. With suppress_defaults, only typed flags appear in the namespace."""
    parser = _Parser(
        prog="train.py",
        description="Train a Hugging Face causal LM with DeepSpeed. Flags follow Hugging Face's spelling.",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
    )
    for f in flag_fields():
        opt = f"--{f.name}"
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if f.type in ("bool", bool):
            if f.default:  # on by default: --name / --no-name
                parser.add_argument(opt, action=argparse.BooleanOptionalAction, help=help_text,
                                    default=argparse.SUPPRESS if suppress_defaults else True)
            else:
                parser.add_argument(opt, action="store_true", help=help_text)
            continue
        kind = {"int": int, "float": float, "Optional[int]": int, "Optional[float]": float}.get(f.type, str)
        default_text = "" if f.default is None else f" (default: {f.default})"
        default = argparse.SUPPRESS if suppress_defaults else f.default
        parser.add_argument(opt, type=kind, default=default, help=help_text + default_text, **meta)
    parser.add_argument(
        "--deepspeed", dest="config", default=argparse.SUPPRESS, help="Alias of --config (Hugging Face spelling).")
    return parser


def parse_run_config(argv: Optional[Sequence[str]] = None) -> RunConfig:
    """Parse flags into a RunConfig and check every value that can be checked without torch."""
    namespace = build_parser().parse_args(argv)
    typed = build_parser(suppress_defaults=True).parse_args(argv)
    explicit = tuple(sorted(name for name in vars(typed) if name != "local_rank"))
    cfg = RunConfig(**{f.name: getattr(namespace, f.name) for f in flag_fields()}, explicit_flags=explicit)
    validate_run_config(cfg)
    return cfg


def run_identity(cfg_dict: dict) -> dict:
    """What makes two runs the same run: the model and the training data (not batch sizes or step counts)."""
    keys = ("model_name_or_path", "config_name", "dataset_name", "dataset_config_name", "train_file", "data_path",
            "dataset_mix")
    return {k: cfg_dict.get(k) for k in keys}


def explain_run_config(cfg: RunConfig) -> str:
    """Every flag with its value and where it came from (typed on the command line, or the default)."""
    lines = []
    for f in flag_fields():
        source = f"--{f.name}" if f.name in cfg.explicit_flags else "default"
        lines.append(f"  {f.name} = {getattr(cfg, f.name)!r}  <- {source}")
    return "\n".join(lines)


def _looks_local(path: str) -> bool:
    """A hub id is `name` or `org/name`; anything else (absolute, ./, ~, deeper folders, a file suffix) is local."""
    return (
        path.startswith(("/", ".", "~"))
        or path.count("/") > 1
        or Path(path).suffix in {".json", ".jsonl"}
        or Path(path).exists()
    )


def _check_model_path(flag: str, value: Optional[str]) -> None:
    if value and _looks_local(value) and not Path(value).expanduser().exists():
        raise UsageError(f"--{flag} {value}: no such file or folder", "give a local model folder or a hub id")


def expand_data_files(value: Optional[str]) -> list:
    """A --train_file/--validation_file value: one path, a glob, or several of either separated by commas."""
    if not value:
        return []
    files = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        expanded = os.path.expanduser(part)
        matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        files += matches or [part]
    return files


def _check_data_file(flag: str, value: Optional[str]) -> None:
    for file in expand_data_files(value):
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


def validate_data_flags(cfg: RunConfig) -> None:
    """The data-source checks train.py and data/prepare.py share."""
    if cfg.dataset_name and cfg.train_file:
        raise UsageError("--dataset_name and --train_file: choose one data source")
    if cfg.validation_file and not (cfg.train_file or cfg.dataset_name):
        raise UsageError("--validation_file needs --train_file (or --dataset_name) too")
    _check_data_file("train_file", cfg.train_file)
    _check_data_file("validation_file", cfg.validation_file)
    if cfg.dataset_name and _looks_local(cfg.dataset_name) and not Path(cfg.dataset_name).expanduser().exists():
        raise UsageError(f"--dataset_name {cfg.dataset_name}: no such folder", "give a hub dataset name or a folder")
    if cfg.data_path and (cfg.train_file or cfg.dataset_name):
        raise UsageError("--data_path and --train_file/--dataset_name: choose one data source",
                         "--data_path is a store that data/prepare.py made; the others are raw data")
    if cfg.dataset_mix and (cfg.data_path or cfg.train_file or cfg.dataset_name):
        raise UsageError("--dataset_mix and another data source: choose one",
                         "--dataset_mix already names every store the run reads")
    if cfg.dataset_mix:
        from scaletrain.data import parse_dataset_mix

        for path, _ in parse_dataset_mix(cfg.dataset_mix):
            if not Path(path).is_dir():
                raise UsageError(f"--dataset_mix: {path} is not a folder", "give stores made by data/prepare.py")
    if cfg.data_path and not Path(cfg.data_path).is_dir():
        raise UsageError(f"--data_path {cfg.data_path}: no such folder", "prepare it with python data/prepare.py")


def validate_run_config(cfg: RunConfig) -> None:
    """Collect the checks that need no model, data or process group. Raises UsageError on the first problem."""
    positive = {
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "per_device_eval_batch_size": cfg.per_device_eval_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "logging_steps": cfg.logging_steps,
    }
    for name, value in positive.items():
        if value < 1:
            raise UsageError(f"--{name} {value}: must be at least 1")
    for name in ("eval_steps", "save_steps", "warmup_steps", "validation_split_percentage", "save_total_limit",
                 "save_interval_minutes", "preemption_grace_seconds", "max_consecutive_skips"):
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name} {getattr(cfg, name)}: must not be negative")
    if cfg.loss_spike_factor != 0 and cfg.loss_spike_factor <= 1:
        raise UsageError(f"--loss_spike_factor {cfg.loss_spike_factor}: must be above 1 (or 0 to turn it off)",
                         "e.g. 3: a step with three times the running mean loss is skipped")
    if cfg.plan:
        for name in ("num_gpus", "num_nodes"):
            if getattr(cfg, name) < 1:
                raise UsageError(f"--{name} {getattr(cfg, name)}: must be at least 1")
        for name in ("gpu_memory_gb", "host_memory_gb"):
            if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
                raise UsageError(f"--{name} {getattr(cfg, name)}: must be positive")
    if cfg.block_size is not None and cfg.block_size < 2:
        raise UsageError(f"--block_size {cfg.block_size}: must be at least 2 (one input and one target token)")
    if cfg.learning_rate <= 0:
        raise UsageError(f"--learning_rate {cfg.learning_rate}: must be positive")
    for name in ("warmup_ratio", "min_lr_ratio", "decay_ratio"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise UsageError(f"--{name} {getattr(cfg, name)}: must be between 0 and 1")
    if cfg.validation_split_percentage >= 100:
        raise UsageError(f"--validation_split_percentage {cfg.validation_split_percentage}: must be below 100")
    for sink in cfg.report_sinks:
        if sink not in REPORT_SINKS:
            close = difflib.get_close_matches(sink, REPORT_SINKS, n=1)
            raise UsageError(f"--report_to {cfg.report_to}: unknown sink \"{sink}\"",
                             f"did you mean {close[0]}?" if close else f"use {', '.join(REPORT_SINKS)}")
    if cfg.profile_steps is not None:
        first, sep, last = cfg.profile_steps.partition("-")
        if not (first.isdigit() and (not sep or last.isdigit())) or int(first) < 1 or \
                (sep and int(last) < int(first)):
            raise UsageError(f"--profile_steps {cfg.profile_steps}: give a step or a range of steps like 5-7",
                             "steps count from 1")
    if cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise UsageError("--max_steps and --num_train_epochs: set one of them to a positive number")
    if cfg.bf16 and cfg.fp16:
        raise UsageError("--bf16 and --fp16: choose one precision")
    if cfg.model_name_or_path and cfg.config_name:
        raise UsageError(
            "--model_name_or_path and --config_name: choose one",
            "--model_name_or_path loads pretrained weights; --config_name trains from scratch",
        )
    config_path = Path(cfg.config)
    if not config_path.is_file():
        raise UsageError(f"--config {cfg.config}: no such file", "pick one of ds_configs/*.json")
    if not os.access(config_path, os.R_OK):
        raise UsageError(f"--config {cfg.config}: file is not readable", "check its permissions")
    _check_model_path("model_name_or_path", cfg.model_name_or_path)
    _check_model_path("config_name", cfg.config_name)
    _check_model_path("tokenizer_name", cfg.tokenizer_name)
    validate_data_flags(cfg)
    output = Path(cfg.output_dir)
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output_dir {cfg.output_dir}: exists and is not a folder")
    previous = output / "run_config.json"
    if previous.exists() and not cfg.overwrite_output_dir and not (cfg.print_config or cfg.plan):
        try:
            before = run_identity(json.loads(previous.read_text()))
        except (OSError, ValueError):
            before = None
        now = run_identity(cfg.to_dict())
        if before is not None and before != now:
            changed = ", ".join(f"{k}: {before[k]} -> {now[k]}" for k in now if before[k] != now[k])
            raise UsageError(
                f"--output_dir {cfg.output_dir}: holds a different run ({changed})",
                "choose another --output_dir, or pass --overwrite_output_dir to replace that run",
            )
        if cfg.resume_from_checkpoint == "none":
            raise UsageError(
                f"--output_dir {cfg.output_dir}: holds a previous run of this model and data",
                "drop --resume_from_checkpoint none to continue it, or pass --overwrite_output_dir to start again",
            )
