"""Everything decided before heavy work: flags, the resolved DeepSpeed config, model config and tokenizer.

Nothing here builds a process group, a model or a dataset, and nothing is written: a mistake found here ends
the run with exit code 2 and leaves the output folder as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from scaletrain.checkpoint import check_push_target, MODEL_CONFIG_FILE, plan_resume
from scaletrain.config import (
    assemble_ds_config,
    check_preference_run,
    check_rampup,
    explain_resolved,
    DSKey,
    HardwareFacts,
    load_ds_config,
    ModelSize,
    parse_run_config,
    resolve_ds_config,
    ResolvedDSConfig,
    RunConfig,
)
from scaletrain.errors import UsageError
from scaletrain.harness import HarnessTasks, resolve_tasks
from scaletrain.data import check_block_size, check_data_source
from scaletrain.distributed import (
    check_model_layout,
    check_pipeline_layout,
    check_sequence_layout,
    layout_ds_keys,
    place_ranks,
)
from scaletrain.engine import check_compile, check_deepspeed_hooks, compile_requested
from scaletrain.train import check_reference_model
from scaletrain.observability import load_eval_prompts, model_flops, ModelShape, read_calibration
from scaletrain.model import (
    check_model_features,
    check_tokenizer_fits,
    describe_model,
    load_model_config,
    load_tokenizer,
    max_positions,
    meta_model,
)
from scaletrain.parts import DistInfo, ParallelLayout
from scaletrain.plan import RunPlan

log = logging.getLogger(__name__)


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


def checkpoint_bytes(n_params: int, precision: str, trainable: int | None = None, merged: bool = False) -> tuple:
    """(bytes of one checkpoint plus the HF export, the arithmetic in words) for AdamW under DeepSpeed. With LoRA
    (`trainable` adapter parameters of n_params) the checkpoint and the export hold the adapter only, plus the
    merged model with --merge_lora."""
    # fp32 weights (the master copy under bf16/fp16) + Adam's two fp32 moments, plus 16-bit module weights
    # under bf16/fp16; the Hugging Face export adds the weights once more in the training dtype.
    weight = 4 if precision == "fp32" else 2
    per_param = 12 + (2 if precision != "fp32" else 0) + weight
    if trainable is None:
        return n_params * per_param, f"{n_params / 1e9:.2f}B parameters x {per_param} bytes"
    extra = n_params * weight if merged else 0
    return trainable * per_param + extra, (
        f"an adapter of {trainable / 1e6:.1f}M parameters x {per_param} bytes"
        + (f", the merged {n_params / 1e9:.2f}B x {weight}" if merged else "")
    )


def _check_disk_space(
    output_dir: str, *, n_params: int, precision: str, trainable: int | None = None, merged: bool = False
) -> None:
    folder = Path(output_dir).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    needed, how = checkpoint_bytes(n_params, precision, trainable, merged)
    if free < needed:
        raise UsageError(
            f"--output_dir {output_dir}: {free / 1e9:.1f} GB free on its disk, one checkpoint and the export "
            f"need about {needed / 1e9:.1f} GB ({how})",
            "free space or point --output_dir at a larger disk",
        )


def resolve_run(argv: Sequence[str] | None, dist: DistInfo) -> RunPlan:
    """Every check before heavy work, one line per concern in the order problems are reported (UsageError, exit 2).
    Each wing checks its own flags; what one check finds is handed on to those after it that need it."""
    cfg = parse_run_config(argv)
    dist, layout = place_ranks(cfg.parallel, cfg.planning, dist)  # under --plan: the planned cluster's layout
    check_deepspeed_hooks()  # a DeepSpeed internal that moved: one line now, not a crash in the first step
    raw_ds_config = load_ds_config(cfg.engine.config)
    model_config = load_model_config(cfg.model)
    check_model_layout(layout, model_config)
    tokenizer = load_tokenizer(cfg.model)
    chat = check_data_source(cfg.data, tokenizer, reads_first_row=dist.rank == 0)  # one hub request, not one a rank
    check_push_target(cfg.checkpoint.push_to_hub, cfg.checkpoint.export_hf_at_end)
    check_tokenizer_fits(cfg.model, model_config, tokenizer)
    block_size = check_block_size(cfg.data, cfg.model.tokenizer_source, tokenizer, max_positions(model_config))
    skeleton, model_facts = describe_model(cfg, model_config)
    hardware = hardware_facts()
    dist = dataclasses.replace(dist, accelerator=hardware.accelerator)  # the device this rank trains on
    shape = ModelShape.from_meta_model(skeleton, model_config)
    filled, layout_keys = _resolve_engine_config(
        cfg, raw_ds_config=raw_ds_config, dist=dist, hardware=hardware, model_config=model_config, shape=shape
    )
    resolved = RunPlan(  # the checks below read the JSON as filled; the layout's and resume's keys join it last
        cfg,
        ds=filled,
        dist=dist,
        model_config=model_config,
        tokenizer=tokenizer,
        block_size=block_size,
        n_params=model_facts["n_params"],
        attn_implementation=skeleton.config._attn_implementation,
        model_facts=model_facts,
        chat=chat,
    )
    router_loss = check_model_features(
        cfg,
        ds=filled,
        skeleton=skeleton,
        model_config=model_config,
        hardware=hardware,
        isolates_documents=resolved.isolates_documents,
    )
    check_preference_run(cfg, chat is not None and chat.kind == "preference", router_loss is not None)
    check_reference_model(cfg, model_config)
    _check_layout(resolved, hardware, layout=layout)
    eval_prompts = load_eval_prompts(
        cfg.logging.eval_prompts,
        tokenizer=tokenizer,
        max_new_tokens=cfg.logging.eval_max_new_tokens,
        max_positions=max_positions(model_config),
        layout=dist.layout,
    )
    lm_eval_tasks = _lm_eval_tasks(cfg, dist)
    resume, resume_keys = plan_resume(cfg, filled, model_facts, dist.layout)
    trained = _trained_model(cfg, skeleton, model_config)
    _check_disk_space_for(cfg, filled, model_facts["n_params"], trained)
    return resolved.replace(
        ds=assemble_ds_config(filled, layout_keys, resume_keys),
        resume=resume,
        flops=model_flops(trained, model_config, block_size),
        model_shape=shape if cfg.planning.plan else None,
        plan_calibration=_plan_calibration(cfg),
        router_loss=router_loss,
        eval_prompts=eval_prompts,
        lm_eval_tasks=lm_eval_tasks,
    )


def _lm_eval_tasks(cfg: RunConfig, dist: DistInfo) -> HarnessTasks | None:
    """--lm_eval_tasks: lm-eval installed, every task known and built (its data found), before training; a layout
    the harness cannot be served on refused. --print_config and --plan look nothing up."""
    args = cfg.lm_eval
    if not args.task_specs or cfg.run.print_config or cfg.planning.plan:
        return None
    flag = f"--lm_eval_tasks {args.lm_eval_tasks}"
    if dist.layout.model_parallel > 1:
        raise UsageError(
            f"{flag}: scoring during training is not supported with tensor, sequence or pipeline parallelism",
            "drop it, and score the exported model after the run: python scripts/evaluate.py <output_dir> --tasks ...",
        )
    return resolve_tasks(args.task_specs, args.lm_eval_limit, dist.layout.dp, flag)


def _plan_calibration(cfg: RunConfig) -> tuple | None:
    """--plan --plan_calibration: the measured run and its model's shape (from the model_config.json every run folder
    keeps, or an older folder's export, config.json)."""
    if not (cfg.planning.plan and cfg.planning.plan_calibration):
        return None
    from transformers import AutoConfig

    run_dir = Path(cfg.planning.plan_calibration)
    calibration = read_calibration(run_dir)
    try:
        kept = run_dir / MODEL_CONFIG_FILE
        model_config = AutoConfig.from_pretrained(str(kept) if kept.is_file() else run_dir)
    except (OSError, ValueError) as err:
        raise UsageError(
            f"--plan_calibration {run_dir}: no readable {MODEL_CONFIG_FILE} or config.json ({err.__class__.__name__})",
            "point it at a finished run's --output_dir",
        ) from None
    return calibration, ModelShape.from_meta_model(meta_model(model_config, False), model_config)


def _check_layout(resolved: RunPlan, hardware: HardwareFacts, *, layout: ParallelLayout) -> None:
    """What the parallel layout (under --plan, the planned cluster's) asks of the block size, attention,
    torch.compile and (pipeline) the model."""
    cfg, ds, attn = resolved.cfg, resolved.ds, resolved.attn_implementation
    check_sequence_layout(layout, resolved.block_size, attn, hardware.accelerator)
    check_compile(compile_requested(cfg.engine.torch_compile, ds.config), resolved.dist.layout, cfg.engine.config)
    if not cfg.planning.plan:  # --plan covers every layout option, whatever this launch is
        slow = check_pipeline_layout(
            layout,
            model_config=resolved.model_config,
            attn_implementation=attn,
            block_size=resolved.block_size,
            isolates_documents=resolved.isolates_documents,
            ds=ds,
            config_path=cfg.engine.config,
        )
        if slow and resolved.dist.is_main:  # a valid layout that idles: said once, and the run goes on
            log.warning(slow)


def _resolve_engine_config(
    cfg: RunConfig, *, raw_ds_config: dict, dist: DistInfo, hardware: HardwareFacts, model_config, shape: ModelShape
) -> tuple[ResolvedDSConfig, tuple[DSKey, ...]]:
    """(the DeepSpeed JSON with every "auto" filled, the keys the parallel layout adds to it), and the engine-side
    checks that need them: the layout's DeepSpeed keys, the batch ramp-up, and whether a non-finite update can be
    skipped."""
    tp, pp = dist.layout.tp, dist.layout.pp
    rank_params = int(shape.params_per_rank(tp, pp)) if tp * pp > 1 else None
    size = ModelSize(_hidden_size(model_config), shape.n_params, rank_params)
    ds = resolve_ds_config(
        raw_ds_config,
        engine=cfg.engine,
        optim=cfg.optim,
        explicit=cfg.explicit_flags,
        dp_world_size=dist.layout.dp,
        hw=hardware,
        model=size,
    )
    # --plan covers every ZeRO option for the layout, whatever --config says
    layout_keys = () if cfg.planning.plan else layout_ds_keys(dist.layout, ds, cfg.engine.config)
    check_rampup(cfg.optim.rampup_batch_size, ds, dist.layout.dp)
    if cfg.nonfinite.on_nonfinite == "skip" and ds.zero_stage == 0 and ds.precision != "fp32":
        raise UsageError(
            f"--on_nonfinite skip: updates of ZeRO stage 0 in {ds.precision} cannot be skipped",
            "use a ZeRO stage 1-3 config, or --on_nonfinite stop",
        )
    return ds, layout_keys


def _check_disk_space_for(cfg: RunConfig, ds: ResolvedDSConfig, n_params: int, trained) -> None:
    """A run that will save: room for one checkpoint and the export (--print_config and --plan save nothing)."""
    if cfg.run.print_config or cfg.planning.plan:
        return
    adapter = sum(p.numel() for p in trained.parameters() if p.requires_grad) if cfg.peft.use_peft else None
    _check_disk_space(
        cfg.run.output_dir, n_params=n_params, precision=ds.precision, trainable=adapter, merged=cfg.peft.merge_lora
    )


def _trained_model(cfg: RunConfig, skeleton, model_config):
    """The meta model as it trains: with --use_peft, the base frozen and the adapter added (FLOPs, disk space)."""
    if not cfg.peft.use_peft:
        return skeleton
    from scaletrain.model import meta_lora_model

    assert cfg.model.model_name_or_path is not None  # --use_peft without it is refused (config _check_peft_run)
    return meta_lora_model(model_config, cfg.peft, cfg.model.model_name_or_path, cfg.model.trust_remote_code)


def print_config(resolved: RunPlan) -> None:
    """--print_config: everything resolved, printed by rank 0; nothing is built or written."""
    if resolved.dist.is_main:
        print(
            explain_resolved(
                resolved.cfg,
                ds=resolved.ds,
                block_size=resolved.block_size,
                n_params=resolved.n_params,
                dp_world_size=resolved.dist.layout.dp,
            )
        )
