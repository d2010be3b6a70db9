"""deepspeed.initialize with the resolved config, AdamW parameter groups and the run's LR schedule."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scaletrain.errors import UsageError
from scaletrain.parts import ParallelLayout
from scaletrain.engine.schedules import LRSchedule

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def parameter_groups(model, weight_decay: float) -> list:
    """Decay matrices only: biases and norm weights (1-D tensors) keep weight_decay 0, as is standard for LMs."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 partitions report their full shape here
        (decay if len(shape) >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_engine(model, *, ds_config: dict, weight_decay: float, schedule: LRSchedule, layout: ParallelLayout):
    """deepspeed.initialize with the run's parameter groups and LR schedule; AutoTP's groups first under tensor
    parallelism. DeepSpeed gets a copy of the config: the run's stays as resolved."""
    import contextlib
    import copy

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.optim.lr_scheduler import LambdaLR

    from scaletrain.engine import ops

    # The optimizer's compiled ops, built or loaded under our lock (a stale torch build lock cannot hang us).
    ops.load_ops(ops.engine_ops(ds_config, get_accelerator().device_name()))
    from deepspeed.pipe import PipelineModule

    from scaletrain.engine.ds_internals import tensor_parallel_mpu, tensor_parallel_stages

    mpu = None
    groups: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if layout.tp > 1 and isinstance(model, PipelineModule):  # AutoTP splits each stage over the grid's groups
        groups = tensor_parallel_stages(model.mpu())
    elif layout.tp > 1:  # AutoTP shards the model inside initialize (tensor_parallel.autotp_size)
        mpu = tensor_parallel_mpu(layout.tp)
    engine_config = copy.deepcopy(ds_config)
    if mpu is not None and layout.sp > 1:
        # AutoTP's data-parallel group is every rank of a tensor coordinate (data x sequence: where ZeRO shards and
        # averages), and DeepSpeed counts each of its ranks in the global batch; each sequence group reads one
        # replica's micro-batches.
        engine_config["train_batch_size"] *= layout.sp
    with groups:
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=parameter_groups(model, weight_decay),
            config=engine_config,
            lr_scheduler=lambda optimizer: LambdaLR(optimizer, schedule.multiplier),
            mpu=mpu,
        )
    if layout.tp > 1 and isinstance(model, PipelineModule):
        from scaletrain.engine.ds_internals import merge_stage_universal_info

        merge_stage_universal_info(engine)  # how every stage's parameters are split, in each stage's checkpoint
    if isinstance(model, PipelineModule) and engine.zero_optimization_stage() == 0 and engine.gradient_clipping() > 0:
        from scaletrain.engine.ds_internals import fix_pipeline_stage0_clipping

        fix_pipeline_stage0_clipping(engine)  # DeepSpeed 0.19.8 clips every stage by stage 0's norm
    log.info(
        f"engine: ZeRO stage {engine.zero_optimization_stage()}, optimizer {type(engine.optimizer).__name__}, schedule "
        f"{schedule.kind} (warmup {schedule.warmup_steps} of {schedule.total_steps} steps)"
    )
    return engine


def compile_requested(torch_compile: bool, ds_config: dict) -> bool:
    """--torch_compile, or a "compile" section in the DeepSpeed JSON (which DeepSpeed only reads when
    engine.compile() is called: without the call the section silently does nothing)."""
    return torch_compile or "compile" in ds_config


def check_compile(requested: bool, layout: ParallelLayout, config_path: str) -> None:
    """torch.compile with a model-parallel layout is refused (untested: Ulysses' all-to-alls, AutoTP's sharded
    linears and the pipeline's stage modules)."""
    if requested and layout.model_parallel > 1:
        raise UsageError(
            f'--torch_compile (or a "compile" section in {config_path}) with tensor, sequence or '
            "pipeline parallelism: not supported here (untested)",
            "compile with data parallelism only, or drop --torch_compile and the section",
        )


def compile_engine(engine, backend: str, mode: str | None) -> float:
    """engine.compile() with the backend and mode; its seconds (the graphs are built lazily, at the first steps:
    that start-up cost shows in their step times)."""
    import time

    started = time.perf_counter()
    engine.compile(backend=backend, compile_kwargs={"mode": mode} if mode else {})
    seconds = time.perf_counter() - started
    log.info(
        "torch.compile: backend %s%s, DeepCompile %s (graphs build during the first steps)",
        backend,
        f", mode {mode}" if mode else "",
        "on" if engine.is_deepcompile_enabled() else "off",
    )
    return seconds


def restore_weight_decay(engine, weight_decay: float) -> None:
    """Put each parameter group's weight decay back after a universal-checkpoint load: DeepSpeed 0.19.8's ZeRO-3
    loader (stage3.py, _load_universal_checkpoint) copies group 0's settings onto every group, so the biases and
    norms (group 1, no decay) would decay from there on, and the resumed run would drift from the one it continues."""
    groups = engine.optimizer.param_groups
    if len(groups) != 2:  # not the two groups parameter_groups() made: nothing to put back
        log.warning(
            "after the universal-checkpoint load the optimizer has %d parameter groups, not 2; their weight "
            "decay is left as loaded",
            len(groups),
        )
        return
    for group, decay in zip(groups, (weight_decay, 0.0), strict=True):  # decay, then no decay (parameter_groups)
        group["weight_decay"] = decay


def repair_universal_load(engine, weight_decay: float) -> None:
    """What DeepSpeed 0.19.8's universal-checkpoint loaders leave wrong: each parameter group's weight decay, and
    under ZeRO-3 one Adam step counter shared by every partition (ds_internals.separate_step_counters)."""
    from scaletrain.engine import ds_internals

    restore_weight_decay(engine, weight_decay)
    shared = ds_internals.separate_step_counters(engine)
    if shared:
        log.info("universal load: %d optimizer states shared one Adam step counter; each has its own now", shared)


def release_engine(engine) -> None:
    """Undo what the engine left outside itself (DeepSpeed's hooks; under ZeRO-3 two module-level references), so it
    and its process groups are freed when the caller drops it, not at interpreter exit, where gloo's threads can abort
    a finished run.
    """
    from scaletrain.engine import ds_internals

    engine.destroy()
    if hasattr(engine, "train_batch"):  # a pipeline engine: its point-to-point groups sit in module globals
        ds_internals.release_pipeline_references()
    if engine.zero_optimization_stage() != 3:
        return

    ds_internals.release_zero3_references(engine.module)
