"""The training loop: the only place that calls engine.backward and engine.step.

Loss normalisation: the loss of a step is the mean over every real (non-padding) target token of the global
batch. Each micro-batch contributes its *sum* of token losses divided by the global target count, so neither
gradient accumulation nor the number of ranks changes the gradient (the Hugging Face accumulation bug is
averaging per micro-batch means instead). DeepSpeed averages gradients over data-parallel ranks, so each rank
multiplies by the data-parallel size to turn that average back into the global sum; `scale_wrt_gas=False`
stops DeepSpeed dividing by the accumulation steps a second time.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from scaletrain.data import IGNORE_INDEX, StepBatches
from scaletrain.faults import Preempted, PreemptionFlag, injected_loss_factor
from scaletrain.nonfinite import NonFiniteGuard, SkipSwitch
from scaletrain.metrics import LogWindow, MetricsLogger, PhaseClock, StepProfiler, ThroughputModel
from scaletrain.state import TrainState

log = logging.getLogger(__name__)


def token_loss_sum(engine, batch: dict):
    """Summed cross-entropy over the batch's real targets (labels shifted by one inside the block)."""
    import torch.nn.functional as F

    input_ids = batch["input_ids"].to(engine.device, non_blocking=True)
    labels = batch["labels"].to(engine.device, non_blocking=True)
    # Padding sits only at the end of a block (right padding) and causal attention never looks ahead, so no
    # attention mask is needed: real tokens never see padding, and padded positions carry no loss.
    extra = {}
    if "position_ids" in batch:  # attention isolation: transformers masks attention per document from these
        extra["position_ids"] = batch["position_ids"].to(engine.device, non_blocking=True)
    logits = engine(input_ids=input_ids, use_cache=False, **extra).logits
    # Shift the labels, not the logits: slicing logits[:, :-1] would copy the largest activation of the step.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def agree_step(device, loss_sum, *flags: bool) -> tuple:
    """(global summed loss, *flags true on any rank): one all-reduce (SUM) at the step boundary, every rank.

    A collective: decisions that depend on a rank's own view (a signal it received, its clock, its batch's loss)
    pass through here, or ranks would decide differently and hang in the next collective.
    """
    import torch
    import deepspeed.comm as ds_comm

    values = torch.zeros(1 + len(flags), dtype=torch.float64, device=device)
    values[0] = loss_sum if torch.is_tensor(loss_sum) else float(loss_sum)
    values[1:] = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64)
    ds_comm.all_reduce(values)
    total, *rest = values.tolist()
    return (total, *[v > 0 for v in rest])


@dataclass(frozen=True)
class LoopSettings:
    max_steps: int
    logging_steps: int
    eval_steps: int
    save_steps: int
    save_interval_minutes: float
    preemption_grace_seconds: float
    dp_world_size: int
    show_progress: bool
    rank: int = 0
    throughput: Optional[ThroughputModel] = None


def evaluate(engine, batches: list) -> dict:
    """Mean loss over a fixed set of validation blocks, across ranks, and its perplexity."""
    import torch
    import deepspeed.comm as ds_comm

    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    with torch.no_grad():
        for batch in batches:
            sums[0] += token_loss_sum(engine, batch).double()
            sums[1] += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    engine.train()
    ds_comm.all_reduce(sums)
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


def train_loop(
    engine,
    batches: StepBatches,
    state: TrainState,
    settings: LoopSettings,
    metrics: MetricsLogger,
    eval_batches: Optional[list],
    save: Callable[[], None],
    preemption: PreemptionFlag,
    profiler: Optional[StepProfiler] = None,
    guard: Optional[NonFiniteGuard] = None,
    switch: Optional[SkipSwitch] = None,
    rollback: Optional[Callable[[], None]] = None,
) -> None:
    """Train until max_steps. Raises Preempted after committing a checkpoint when any rank was signalled."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    engine.train()
    last_save = time.monotonic()
    pending_checkpoint = 0.0
    window = LogWindow()
    clock = PhaseClock(engine.device)
    bar = tqdm(total=settings.max_steps, initial=state.step, disable=not settings.show_progress,
               desc="training", unit="step", dynamic_ncols=True)
    with logging_redirect_tqdm():
        while state.step < settings.max_steps:
            if profiler:
                profiler.before_step(state.step + 1)
            started = time.perf_counter()
            clock.start()
            data_step = state.step + state.data_offset  # rollbacks jump the data past offending batches
            micro_batches, global_targets, n_blocks = batches.for_step(data_step)
            clock.lap("data_wait")
            scale = settings.dp_world_size / max(global_targets, 1)
            loss_sum = 0.0
            forced = None
            for i, batch in enumerate(micro_batches):
                summed = token_loss_sum(engine, batch)
                factor = injected_loss_factor(data_step + 1, settings.rank)  # TEST-ONLY hook, inert in use
                if factor is not None:
                    summed = summed * factor
                clock.lap("forward")
                engine.backward(summed * scale, scale_wrt_gas=False)
                clock.lap("backward")
                loss_sum = loss_sum + summed.detach()
                if i == len(micro_batches) - 1:
                    # One small all-reduce before the update: the global loss (for the non-finite and spike
                    # checks) and the flags every rank must agree on at this step boundary.
                    interval_due = bool(settings.save_interval_minutes) and \
                        time.monotonic() - last_save >= 60 * settings.save_interval_minutes
                    global_loss_sum, preempted, interval_due = agree_step(
                        engine.device, loss_sum, preemption.signal_name is not None, interval_due)
                    global_loss = global_loss_sum / max(global_targets, 1)
                    forced = guard.judge(global_loss) if guard else None
                    if switch:
                        switch.skip = forced is not None
                    clock.lap("sync")
                engine.step()  # an optimizer update only at the accumulation boundary
                clock.lap("optimizer")
            if switch:
                switch.skip = False
            applied = engine.was_step_applied()
            state.step += 1
            state.samples_seen += n_blocks
            verdict = "ok" if guard is None else guard.after_step(
                state.step, global_loss, forced, applied,
                lambda: batches.sample_ids(data_step))
            if not applied:
                state.skipped_steps += 1
            else:
                state.tokens_seen += global_targets
            last = state.step == settings.max_steps
            if verdict == "rollback":
                rollback()  # restores the last committed checkpoint and moves the data past this streak
                window = LogWindow()
                bar.reset(total=settings.max_steps)
                bar.update(state.step)
                continue
            # A save's time joins the next step's (a step's record is written before its checkpoint, so a crash
            # right after a commit never loses the record of the step the run resumes from).
            clock.phases["checkpoint"] += pending_checkpoint
            window.add(loss_sum, global_targets, n_blocks, time.perf_counter() - started + pending_checkpoint,
                       clock.phases, engine.get_global_grad_norm(), skipped=not applied)
            pending_checkpoint = 0.0
            if profiler:
                profiler.after_step(state.step)
            bar.update(1)

            if state.step % settings.logging_steps == 0 or last or preempted:
                summary = window.summarize(engine.device, settings.throughput)
                if summary["loss"] is not None:
                    bar.set_postfix(loss=f"{summary['loss']:.3f}")
                metrics.log({"step": state.step, "epoch": round(state.samples_seen / len(batches.blocks), 4),
                             "time": round(time.time(), 3), **summary, "lr": engine.get_lr()[0],
                             "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps})
                window = LogWindow()
            if preempted:
                save_started = time.perf_counter()
                save()
                seconds = time.perf_counter() - save_started
                log.info("preemption (%s): checkpoint committed at step %d in %.1fs", preemption.signal_name or
                         "signal on another rank", state.step, seconds)
                if seconds > settings.preemption_grace_seconds:
                    log.warning("the preemption save took %.1fs, more than --preemption_grace_seconds %.0f: ask the "
                                "scheduler for an earlier signal", seconds, settings.preemption_grace_seconds)
                raise Preempted(state.step)
            if eval_batches and settings.eval_steps and state.step % settings.eval_steps == 0 and not last:
                metrics.log({"step": state.step, **evaluate(engine, eval_batches)})
            if not last and (interval_due or (settings.save_steps and state.step % settings.save_steps == 0)):
                save_started = time.perf_counter()
                save()
                pending_checkpoint = time.perf_counter() - save_started
                last_save = time.monotonic()
    bar.close()
