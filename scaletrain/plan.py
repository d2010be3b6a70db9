"""Everything decided before heavy work: flags, the resolved DeepSpeed config, model config and tokenizer.

Nothing here builds a process group, a model or a dataset, and nothing is written: a mistake found here ends
the run with exit code 2 and leaves the output folder as it was.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from scaletrain.config import RunConfig, UsageError, parse_run_config
from scaletrain.distributed import DistInfo
from scaletrain.dsconfig import HardwareFacts, ResolvedDSConfig, load_ds_config, resolve_ds_config
from scaletrain.model import load_model_config, load_tokenizer, max_positions

log = logging.getLogger(__name__)
RUN_CONFIG_FILE = "run_config.json"
DS_CONFIG_FILE = "ds_config.json"


@dataclass(frozen=True)
class RunPlan:
    cfg: RunConfig
    ds: ResolvedDSConfig
    model_config: Any
    tokenizer: Any
    block_size: int


def hardware_facts() -> HardwareFacts:
    import torch
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return HardwareFacts(accelerator=name, bf16_fast=name == "cuda" and torch.cuda.is_bf16_supported())


def _hidden_size(model_config) -> int:
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UsageError(f"{type(model_config).__name__}: cannot find the model's hidden size")


def _block_size(cfg: RunConfig, model_config) -> int:
    limit = max_positions(model_config)
    if cfg.block_size is None:
        return min(1024, limit)
    if cfg.block_size > limit:
        raise UsageError(
            f"--block_size {cfg.block_size}: above the model's maximum positions ({limit})",
            f"use --block_size {limit} or less",
        )
    return cfg.block_size


def plan_run(argv: Optional[Sequence[str]], dist: DistInfo) -> RunPlan:
    cfg = parse_run_config(argv)
    raw_ds_config = load_ds_config(cfg.config)
    model_config = load_model_config(cfg)
    tokenizer = load_tokenizer(cfg)
    vocab = getattr(model_config.get_text_config(), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise UsageError(
            f"--tokenizer_name {cfg.tokenizer_source}: {len(tokenizer)} tokens, but the model's vocabulary has {vocab}",
            "use the model's own tokenizer, or a config whose vocab_size covers the tokenizer",
        )
    block_size = _block_size(cfg, model_config)
    ds = resolve_ds_config(raw_ds_config, cfg, dist.dp_world_size, _hidden_size(model_config), hardware_facts())
    return RunPlan(cfg, ds, model_config, tokenizer, block_size)


def describe_plan(plan: RunPlan, dist: DistInfo) -> None:
    log.info("launch: %s, world size %d", dist.launcher, dist.world_size)
    log.info("precision: %s (%s)", plan.ds.precision, plan.ds.precision_reason)
    log.info("resolved DeepSpeed config (%s):\n%s", plan.cfg.config, plan.ds.explained())


def write_run_folder(plan: RunPlan, extra: dict, is_main: bool) -> None:
    """Save the resolved configs beside the run's outputs, so the run can be read back and repeated."""
    if not is_main:
        return
    out = Path(plan.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_config = {**plan.cfg.to_dict(), "block_size": plan.block_size, **extra}
    (out / RUN_CONFIG_FILE).write_text(json.dumps(run_config, indent=2) + "\n")
    (out / DS_CONFIG_FILE).write_text(json.dumps(plan.ds.config, indent=2) + "\n")
