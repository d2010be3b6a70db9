"""The checks of a whole RunConfig, slice by slice and then across slices (LoRA's limits, the output folder), before
any model, data or process group exists. The first problem found raises UsageError.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from scaletrain.config.deepspeed_json import ResolvedDSConfig
from scaletrain.config.run_config import RunConfig
from scaletrain.config.slices import PeftArgs
from scaletrain.errors import UsageError


def run_identity(cfg_dict: dict) -> dict:
    """What makes two runs the same run: the model and the training data (not batch sizes or step counts)."""
    keys = (
        "model_name_or_path",
        "config_name",
        "dataset_name",
        "dataset_config_name",
        "train_file",
        "data_path",
        "dataset_mix",
    )
    return {k: cfg_dict.get(k) for k in keys}


def _check_peft_run(cfg: RunConfig) -> None:
    """LoRA adapts pretrained weights on data parallelism; its flags act only with --use_peft."""
    peft_flags = [f.name for f in dataclasses.fields(PeftArgs) if f.name != "use_peft"]
    if not cfg.peft.use_peft:
        given = [name for name in peft_flags if name in cfg.sources]
        if given:
            raise UsageError(f"--{given[0]}: only acts with --use_peft", "add --use_peft, or drop the flag")
        return
    if not cfg.model.model_name_or_path:
        raise UsageError(
            "--use_peft: needs --model_name_or_path (LoRA adapts a pretrained model's weights)",
            "give the pretrained model's folder or hub id",
        )
    parallel = cfg.parallel
    for name in ("tensor_parallel_size", "sequence_parallel_size", "pipeline_parallel_size"):
        if getattr(parallel, name) > 1:
            raise UsageError(
                f"--use_peft with --{name} {getattr(parallel, name)}: not supported here (untested)",
                "train the adapter with data parallelism and a ZeRO stage",
            )
    if cfg.engine.torch_compile:
        raise UsageError("--use_peft with --torch_compile: not supported here (untested)", "drop --torch_compile")


def _check_output_dir(cfg: RunConfig) -> None:
    """A folder holding another run (other model or data) is refused; so is starting afresh over a previous run."""
    run = cfg.run
    output = Path(run.output_dir)
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output_dir {run.output_dir}: exists and is not a folder")
    previous = output / "run_config.json"
    if not previous.exists() or run.overwrite_output_dir or run.print_config or cfg.planning.plan:
        return
    try:
        before = run_identity(json.loads(previous.read_text()))
    except (OSError, ValueError):
        before = None
    now = run_identity(cfg.to_dict())
    if before is not None and before != now:
        changed = ", ".join(f"{k}: {before[k]} -> {now[k]}" for k in now if before[k] != now[k])
        raise UsageError(
            f"--output_dir {run.output_dir}: holds a different run ({changed})",
            "choose another --output_dir, or pass --overwrite_output_dir to replace that run",
        )
    if cfg.checkpoint.resume_from_checkpoint == "none":
        raise UsageError(
            f"--output_dir {run.output_dir}: holds a previous run of this model and data",
            "drop --resume_from_checkpoint none to continue it, or pass --overwrite_output_dir to start again",
        )


def validate_run_config(cfg: RunConfig) -> None:
    """The checks that need no model, data or process group, slice by slice. Raises UsageError on the first."""
    for slice_name in (
        "optim",
        "parallel",
        "nonfinite",
        "hang",
        "checkpoint",
        "data",
        "logging",
        "lm_eval",
        "planning",
        "engine",
        "model",
        "peft",
    ):
        getattr(cfg, slice_name).validate()
    _check_peft_run(cfg)
    _check_pipeline_export(cfg)
    _check_output_dir(cfg)


def _check_pipeline_export(cfg: RunConfig) -> None:
    """Under pipeline parallelism the export at the end is written from the final checkpoint's layer files (no rank
    holds the whole model): without that checkpoint it would export an older one's weights, or none."""
    ckpt, pp = cfg.checkpoint, cfg.parallel.pipeline_parallel_size
    if pp > 1 and ckpt.export_hf_at_end and not ckpt.save_at_end and not (cfg.run.dry_run or cfg.planning.plan):
        raise UsageError(
            f"--no-save_at_end with --pipeline_parallel_size {pp}: the Hugging Face export at the end is written from "
            "the final checkpoint's layer files",
            "drop --no-save_at_end, or add --no-export_hf_at_end (and export a checkpoint later with "
            "scripts/export_hf.py)",
        )


def check_rampup(rampup: tuple | None, ds: ResolvedDSConfig, dp_world_size: int) -> None:
    """--rampup_batch_size fits the run's batch: every stage is whole micro-batches on every data-parallel rank, and
    the ramp ends exactly at the full global batch."""
    if rampup is None:
        return
    start, increment, samples = rampup
    micro, full = ds.config["train_micro_batch_size_per_gpu"], ds.config["train_batch_size"]
    unit = micro * dp_world_size
    flag = f"--rampup_batch_size {start} {increment} {samples}"
    if start >= full:
        raise UsageError(
            f"{flag}: START {start} is not below the global batch {full} (micro batch {micro} x "
            f"accumulation {full // unit} x data-parallel size {dp_world_size})",
            "start smaller, or drop the flag",
        )
    for name, value in (("START", start), ("INCREMENT", increment)):
        if value % unit:
            raise UsageError(
                f"{flag}: {name} {value} is not a multiple of micro batch {micro} x data-parallel "
                f"size {dp_world_size} = {unit}",
                f"use a multiple of {unit}",
            )
    if (full - start) % increment:
        raise UsageError(
            f"{flag}: INCREMENT {increment} does not divide the ramp from {start} to the global batch {full}",
            f"choose an INCREMENT that divides {full - start}",
        )
    if samples < (full - start) // increment:
        raise UsageError(
            f"{flag}: SAMPLES {samples} is fewer than the ramp's {(full - start) // increment} stages",
            "ramp over more samples",
        )
