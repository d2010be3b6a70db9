"""What the training loop is given: its settings (step counts, intervals, the loss normaliser's divisor, the objective)
and its hooks (sinks, saves, signals, guards), and how a run's resolved configuration becomes those settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.engine import SkipSwitch
from scaletrain.observability import MetricsLogger, StepProfiler, ThroughputModel, throughput_model
from scaletrain.train.nonfinite import NonFiniteGuard
from scaletrain.train.preemption import PreemptionFlag

RAMPUP_LR_EXPONENTS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


@dataclass(frozen=True)
class LoopSettings:
    max_steps: int
    logging_steps: int
    eval_steps: int
    save_steps: int
    save_interval_minutes: float
    preemption_grace_seconds: float
    gradient_divisor: int  # the ranks DeepSpeed averages gradients over (the data-parallel ones; all under SP)
    show_progress: bool
    throughput: ThroughputModel | None = None
    rampup_lr_exponent: float = 0.0  # during a batch ramp-up the LR is scaled by (batch / full batch) ** this
    # This rank's share of the reported loss: the ranks of a tensor-parallel group compute the same loss, so only the
    # first of each group counts (0 x NaN is NaN: a non-finite loss is still seen).
    loss_share: float = 1.0
    router_loss: Any = None  # an MoE model's load-balancing loss (scaletrain.model.moe.RouterLoss), or None
    # A preference run's micro-batch objective (scaletrain.train.preference.PreferenceObjective): (summed per-pair
    # loss, {metric: sum}); None: the token loss.
    objective: Any = None


@dataclass(frozen=True)
class LoopHooks:
    """What the loop calls out to besides the engine and the data: sinks, saves, signals, the non-finite guard."""

    metrics: MetricsLogger
    save: Callable[[], Any]  # a checkpoint of the current step (a collective: every rank calls it), maybe async
    preemption: PreemptionFlag
    eval_sets: dict | None = None  # {validation split: EvalBatches}, read lazily from the store
    profiler: StepProfiler | None = None
    guard: NonFiniteGuard | None = None
    switch: SkipSwitch | None = None  # lets the guard skip an update through DeepSpeed's overflow path
    rollback: Callable[[], None] | None = None  # the guard's "rollback": back to the last committed checkpoint
    pipeline: Any = None  # a PipelineStep: the step runs through DeepSpeed's pipe schedule (train_batch)
    comm_log: Any = None  # --comms_log: scaletrain.observability.comms_log.CommLog, read once per logging window
    generate: Callable[[int], None] | None = None  # --eval_prompts: greedy generations at each evaluation
    ledger: Any = None  # observability.GoodputLedger: each step's time, evaluations', saves'
    save_now: Callable[[], Any] | None = None  # a save committed before it returns (a preemption); default: save
    commit_pending: Callable[[], None] | None = None  # --async_save: commit the save in flight once written
    watch: Any = None  # train.hang.HangWatch: where the loop is, for the hang watch (--hang_timeout)


def loop_settings(resolved, dist, start_step: int, total_steps: int, objective=None) -> LoopSettings:
    """The loop's settings for a run (`resolved`: preflight.ResolvedRun, `dist`: its DistInfo). A dry run takes one
    full step, logged, and saves or evaluates nothing."""
    cfg = resolved.cfg
    dry = cfg.run.dry_run
    return LoopSettings(
        max_steps=min(start_step + 1, total_steps) if dry else total_steps,
        logging_steps=1 if dry else cfg.logging.logging_steps,
        eval_steps=0 if dry else cfg.logging.eval_steps,
        save_steps=0 if dry else cfg.checkpoint.save_steps,
        save_interval_minutes=0 if dry else cfg.checkpoint.save_interval_minutes,
        preemption_grace_seconds=cfg.checkpoint.preemption_grace_seconds,
        gradient_divisor=dist.dp_world_size * dist.sequence_parallel_size,
        loss_share=1.0 if dist.tp_rank == 0 else 0.0,
        show_progress=dist.is_main and not cfg.logging.disable_tqdm,
        throughput=throughput_model(
            resolved.flops,
            dist.accelerator,
            resolved.ds.precision,
            cfg.logging.peak_tflops,
            cfg.model.gradient_checkpointing,
            dist.world_size,
            dist.is_main,
        ),
        rampup_lr_exponent=RAMPUP_LR_EXPONENTS[cfg.optim.rampup_lr_scaling],
        router_loss=resolved.router_loss,
        objective=objective,
    )
