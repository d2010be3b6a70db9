"""The training loop: the only place that calls engine.backward and engine.step (engine.train_batch, which runs
both inside DeepSpeed's pipeline schedule, under pipeline parallelism).

Loss normalisation: the loss of a step is the mean over every real (non-padding) target token of the global
batch. Each micro-batch contributes its *sum* of token losses divided by the global target count, so neither
gradient accumulation nor the number of ranks changes the gradient (the Hugging Face accumulation bug is
averaging per micro-batch means instead). DeepSpeed averages gradients over data-parallel ranks, so each rank
multiplies by the data-parallel size to turn that average back into the global sum (under sequence parallelism
DeepSpeed averages over every rank, each holding part of a block: see scaletrain/distributed/sequence_parallel.py);
`scale_wrt_gas=False` stops DeepSpeed dividing by the accumulation steps a second time. Preference pairs
(scaletrain/train/preference.py) follow the same rule with pairs for tokens: each micro-batch's summed per-pair loss
over the global batch's pair count, so the step's loss is the mean over its pairs.

Mixture-of-experts models (scaletrain/model/moe.py) add the router's load-balancing loss: the objective of a step is
token-mean cross-entropy + coef x aux, with aux the mean over the step's M micro-batches on each of the D ranks
DeepSpeed averages over of each micro-batch's own aux (transformers' per-batch statistic, not a sum over tokens).
Each micro-batch's backward value is therefore

    loss_sum x D / global_targets + coef x aux / M

DeepSpeed's average over the D ranks turns sum_ranks sum_micro (coef x aux / M) / D into coef x mean(aux), as it
turns the first term into the global token mean. The logged `loss` stays the cross-entropy alone (runs with and
without MoE compare), `aux_loss` is the step's mean aux, not multiplied by coef; evaluation reports cross-entropy.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from scaletrain.data import EvalBatches, IGNORE_INDEX, StepBatches
from scaletrain.config import eval_metric_prefix
from scaletrain.errors import Preempted
from scaletrain.train.preemption import record_preemption_saved
from scaletrain.observability import LogWindow, PhaseClock
from scaletrain.train.losses import token_and_router_losses, token_loss_sum
from scaletrain.train.nonfinite import NonFiniteGuard
from scaletrain.train.settings import LoopHooks, LoopSettings
from scaletrain.train.state import TrainState

log = logging.getLogger(__name__)


def agree_step(device, loss_sum, *flags: bool) -> tuple:
    """(global summed loss, *flags true on any rank): one all-reduce (SUM) at the step boundary, every rank.

    A collective: decisions that depend on a rank's own view (a signal it received, its clock, its batch's loss)
    pass through here, or ranks would decide differently and hang in the next collective.
    """
    import deepspeed.comm as ds_comm
    import torch

    values = torch.zeros(1 + len(flags), dtype=torch.float64, device=device)
    values[0] = loss_sum if torch.is_tensor(loss_sum) else float(loss_sum)
    values[1:] = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64)
    ds_comm.all_reduce(values)
    total, *rest = values.tolist()
    return (total, *[v > 0 for v in rest])


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, as the loop books it."""

    loss_sum: Any  # this rank's summed token losses (a device tensor: no host sync per step)
    targets: int  # the global batch's loss targets
    blocks: int  # the global batch's blocks
    global_loss: float  # the step's loss: every rank's summed losses over the global targets
    preempted: bool  # a preemption signal reached some rank (agreed by all)
    interval_due: bool  # --save_interval_minutes has passed (agreed by all: the ranks' clocks differ)
    forced: str | None  # why the guard skipped the update, or None
    applied: bool  # the update happened (DeepSpeed also refuses one whose gradient norm is not finite)
    aux_share: Any = None  # MoE: this rank's share of the step's mean load-balancing loss (summed over ranks: the mean)
    metric_sums: dict | None = None  # a preference step's metric sums on this rank (over ranks / targets: the mean)
    tokens: int | None = None  # tokens the step processed where they are not its targets (preference pairs)


class StepTimers:
    """The phase clock of the step in flight, and the save clock: --save_interval_minutes, and the time of a save,
    which joins the next step's (a step's record is written before its checkpoint, so a crash right after a commit
    never loses the record of the step the run resumes from)."""

    def __init__(self, device, save_interval_minutes: float):
        self.clock = PhaseClock(device)
        self.measure_phases = True  # split the next step into phases (on a GPU: only the steps that are logged)
        self.save_interval_s = 60 * save_interval_minutes
        self.last_save = time.monotonic()
        self.pending_checkpoint = 0.0

    def save_due(self) -> bool:
        return bool(self.save_interval_s) and time.monotonic() - self.last_save >= self.save_interval_s

    def timed_save(self, save: Callable[[], Any]) -> float:
        """Run `save`; its seconds, which the next step's record counts."""
        started = time.perf_counter()
        save()
        self.pending_checkpoint = time.perf_counter() - started
        self.last_save = time.monotonic()
        return self.pending_checkpoint

    def start_step(self) -> PhaseClock:
        """The clock, started for the step in flight."""
        self.clock.start(self.measure_phases)
        return self.clock

    def close_step(self, started: float) -> tuple:
        """(wall-clock seconds, phases or None where the step was not split) of the step that began at `started`,
        the pending save's time in both."""
        self.clock.phases["checkpoint"] += self.pending_checkpoint
        seconds = time.perf_counter() - started + self.pending_checkpoint
        self.pending_checkpoint = 0.0
        return seconds, self.clock.phases if self.clock.measured else None


def evaluate_sets(engine, sets: dict, evaluator=None) -> dict:
    """Each validation set's mean loss and perplexity: eval_loss for the unnamed set, eval_<name>_loss for each
    named one (--validation_file name=path,...), in the order given. `evaluator`: what evaluates instead of the token
    loss here (a PipelineStep, or a preference run's objective), through its `evaluate(engine, batches, prefix)`."""
    run_eval = evaluator.evaluate if evaluator else evaluate
    return {
        key: value
        for split, batches in sets.items()
        for key, value in run_eval(engine, batches, eval_metric_prefix(split)).items()
    }


def evaluate(engine, batches: EvalBatches, prefix: str = "eval_") -> dict:
    """Mean loss over a fixed set of validation blocks, across ranks, and its perplexity."""
    import deepspeed.comm as ds_comm
    import torch

    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    with torch.no_grad():
        for batch in batches:
            sums[0] += token_loss_sum(engine, batch).double()
            sums[1] += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    engine.train()
    ds_comm.all_reduce(sums)
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    return {f"{prefix}loss": loss, f"{prefix}perplexity": math.exp(min(loss, 50.0))}


def train_loop(engine, batches: StepBatches, state: TrainState, settings: LoopSettings, hooks: LoopHooks) -> None:
    """Train until max_steps. Raises Preempted after committing a checkpoint when any rank was signalled."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    engine.train()
    timers = StepTimers(engine.device, settings.save_interval_minutes)
    window = LogWindow()
    bar = tqdm(
        total=settings.max_steps,
        initial=state.step,
        disable=not settings.show_progress,
        desc="training",
        unit="step",
        dynamic_ncols=True,
    )
    first = True  # the first step of an attempt (compiles, warms up) has the long allowance
    with logging_redirect_tqdm():
        while state.step < settings.max_steps:
            _note(hooks, "forward/backward", state.step + 1, long=first)
            first = False
            if hooks.profiler:
                hooks.profiler.before_step(state.step + 1)
            started = time.perf_counter()
            if hooks.ledger:
                hooks.ledger.step_started()
            timers.measure_phases = _logged(state.step + 1, settings)  # a GPU synchronises per phase only then
            data_step = state.step + state.data_offset  # rollbacks jump the data past offending batches
            step = hooks.pipeline.step if hooks.pipeline else optimizer_step
            result = step(engine, batches, data_step, settings, hooks, timers)
            if _count_step(state, result, hooks.guard, partial(batches.sample_ids, data_step)) == "rollback":
                _note(hooks, "rollback", long=True)
                hooks.rollback()  # restores the last committed checkpoint and moves the data past this streak
                if hooks.ledger:
                    hooks.ledger.rolled_back(state.step)
                window = LogWindow()
                bar.reset(total=settings.max_steps)
                bar.update(state.step)
                continue
            saving = timers.pending_checkpoint  # the save before this step, which held it
            seconds, phases = timers.close_step(started)
            if hooks.ledger:
                hooks.ledger.step(state.step, seconds, phases["data_wait"] if phases else 0.0, saving)
            window.add(
                result.loss_sum,
                result.targets,
                result.blocks,
                seconds,
                phases,
                engine.get_global_grad_norm(),
                skipped=not result.applied,
                aux_share=result.aux_share,
                metric_sums=result.metric_sums,
                tokens=result.tokens,
            )
            if hooks.profiler:
                hooks.profiler.after_step(state.step)
            if hooks.commit_pending is not None:  # a background save: committed once every rank's write is done
                hooks.commit_pending()  # (before this step's record: a failed write is said before more is written)
            bar.update(1)
            last = state.step == settings.max_steps
            if _logged(state.step, settings) or result.preempted:
                _log_window(engine, window, bar, state, settings, hooks, batches)
                window = LogWindow()
                if hooks.ledger:  # so that a kill -9 loses at most a logging window of the ledger
                    hooks.ledger.write()
            if result.preempted:
                _note(hooks, "preemption save", long=True)
                _save_for_preemption(state.step, settings, hooks, timers)
                raise Preempted(state.step)
            if not last:  # at the last step finish() evaluates and saves
                _evaluate_when_due(engine, state.step, settings, hooks)
                _save_when_due(state.step, settings, hooks, timers, result.interval_due)
    bar.close()


def optimizer_step(
    engine, batches: StepBatches, data_step: int, settings: LoopSettings, hooks: LoopHooks, timers: StepTimers
) -> StepResult:
    """One optimizer step on the global batch of `data_step` (0-based): every micro-batch's forward and backward,
    the step-boundary agreement, the guard's judgement, then the update at the accumulation boundary (skipped on
    every rank when the guard forces it)."""
    clock = timers.start_step()
    micro_batches, targets, blocks = batches.for_step(data_step)
    clock.lap("data_wait")
    scale = settings.gradient_divisor / max(targets, 1)
    set_accumulation(engine, len(micro_batches))
    backward = partial(
        _forward_backward,
        engine,
        scale=scale,
        clock=clock,
        router_loss=settings.router_loss,
        micro_batches=len(micro_batches),
        objective=settings.objective,
    )
    *accumulating, boundary = micro_batches
    loss_sum, aux_sum, metric_sums = 0.0, 0.0, None
    for batch in accumulating:
        engine.set_gradient_accumulation_boundary(False)
        summed, aux, metrics = backward(batch)
        loss_sum, aux_sum, metric_sums = loss_sum + summed, aux_sum + aux, _add_sums(metric_sums, metrics)
        engine.step()  # inside the accumulation: no update, DeepSpeed counts the micro-batch
        clock.lap("optimizer")
    # The boundary is ours, not DeepSpeed's count of micro-steps modulo the accumulation steps, which a change of
    # the accumulation (a ramp-up stage) would put in the middle of a step.
    engine.set_gradient_accumulation_boundary(True)
    summed, aux, metrics = backward(boundary)
    metric_sums = _add_sums(metric_sums, metrics)
    loss_sum = (loss_sum + summed) * settings.loss_share
    aux_share = (
        None
        if settings.router_loss is None
        else (aux_sum + aux) * settings.loss_share / (len(micro_batches) * settings.gradient_divisor)
    )
    # One small all-reduce before the update: the global loss (for the non-finite and spike checks) and the flags
    # every rank must agree on at this step boundary.
    _note(hooks, "step-boundary all-reduce")
    global_loss_sum, preempted, interval_due = agree_step(
        engine.device, loss_sum, hooks.preemption.signal_name is not None, timers.save_due()
    )
    global_loss = global_loss_sum / max(targets, 1)
    forced = hooks.guard.judge(global_loss) if hooks.guard else None
    if hooks.switch:
        hooks.switch.skip = forced is not None
    clock.lap("sync")
    _note(hooks, "optimizer update")
    with scaled_lr(engine, rampup_lr_factor(batches, data_step, settings)):
        engine.step()  # the update, at the accumulation boundary
    clock.lap("optimizer")
    if hooks.switch:
        hooks.switch.skip = False
        if forced is not None:
            hooks.switch.confirm_skipped(engine)
    return StepResult(
        loss_sum,
        targets,
        blocks,
        global_loss,
        preempted,
        interval_due,
        forced,
        applied=engine.was_step_applied(),
        aux_share=aux_share,
        metric_sums=metric_sums,
        tokens=batches.tokens_for(data_step) if settings.objective is not None else None,
    )


def _add_sums(total: dict | None, more: dict | None) -> dict | None:
    """Metric sums of the micro-batches so far, plus one more's (None: a token-loss step has none)."""
    if more is None:
        return total
    return dict(more) if total is None else {name: total[name] + value for name, value in more.items()}


class PipelineStep:
    """One optimizer step under pipeline parallelism: DeepSpeed's pipe engine runs the whole 1F1B schedule (every
    micro-batch's forward and backward, the gradient reductions, the update) inside train_batch. The step-boundary
    agreement of optimizer_step runs right before the update, from inside the schedule, on every rank
    (ds_internals.before_pipeline_update)."""

    def __init__(self, engine, loss):
        from scaletrain.engine import before_pipeline_update

        self.loss = loss  # scaletrain.distributed.pipeline.TokenLoss, the pipe engine's loss_fn
        self._before_update: Callable[[], None] | None = None
        before_pipeline_update(engine, self._agree)

    def _agree(self) -> None:
        if self._before_update is not None:
            self._before_update()

    def step(
        self, engine, batches: StepBatches, data_step: int, settings: LoopSettings, hooks: LoopHooks, timers: StepTimers
    ) -> StepResult:
        from scaletrain.distributed import pipe_micro_batches

        clock = timers.start_step()
        micro_batches, targets, blocks = batches.for_step(data_step)
        clock.lap("data_wait")
        set_accumulation(engine, len(micro_batches))
        # The pipe engine divides each micro-batch's backward by the accumulation steps: fold them back in.
        self.loss.scale = settings.gradient_divisor * len(micro_batches) / max(targets, 1)
        self.loss.loss_sum = 0.0
        agreed: dict = {}

        def before_update() -> None:  # the last stage holds the losses; every other rank adds 0
            clock.lap("pipeline")
            _note(hooks, "step-boundary all-reduce")
            total, preempted, interval_due = agree_step(
                engine.device, self.loss.loss_sum, hooks.preemption.signal_name is not None, timers.save_due()
            )
            global_loss = total / max(targets, 1)
            forced = hooks.guard.judge(global_loss) if hooks.guard else None
            if hooks.switch:
                hooks.switch.skip = forced is not None
            agreed.update(global_loss=global_loss, preempted=preempted, interval_due=interval_due, forced=forced)
            clock.lap("sync")

        self._before_update = before_update
        try:  # the LR is read only by the update at the schedule's end: scaling it around the whole batch is exact
            with scaled_lr(engine, rampup_lr_factor(batches, data_step, settings)):
                engine.train_batch(data_iter=iter(pipe_micro_batches(micro_batches)))
        finally:
            self._before_update = None
            if hooks.switch:
                hooks.switch.skip = False
        if hooks.switch and agreed["forced"] is not None:
            hooks.switch.confirm_skipped(engine)
        clock.lap("optimizer")
        return StepResult(
            self.loss.loss_sum,
            targets,
            blocks,
            agreed["global_loss"],
            agreed["preempted"],
            agreed["interval_due"],
            agreed["forced"],
            applied=engine.was_step_applied(),
        )

    def evaluate(self, engine, batches: EvalBatches, prefix: str = "eval_") -> dict:
        """Mean loss over the evaluation blocks through the pipe's inference schedule, across ranks."""
        import deepspeed.comm as ds_comm
        import torch

        from scaletrain.distributed import pipe_micro_batches

        self.loss.scale, self.loss.loss_sum = 1.0, 0.0
        # The stages agree on an activation's shape once per schedule, so each run of equal-shaped batches (the
        # last evaluation batch may be smaller) is its own eval_batch; training's shape is agreed again after.
        # Each batch is built from the store as the schedule reads it (a run holds indices, not tensors).
        for _, same_shape in itertools.groupby(range(len(batches)), key=batches.rows):
            group = list(same_shape)
            engine.reset_activation_shape()
            engine.eval_batch(
                data_iter=(pipe_micro_batches([batches[i]])[0] for i in group), num_micro_batches=len(group)
            )
        engine.reset_activation_shape()
        engine.train()
        sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
        if engine.is_last_stage():  # one rank per data-parallel replica counts its batches
            sums[0] += self.loss.loss_sum.double() if torch.is_tensor(self.loss.loss_sum) else self.loss.loss_sum
            sums[1] += batches.targets()
        ds_comm.all_reduce(sums)
        loss = (sums[0] / sums[1].clamp(min=1)).item()
        return {f"{prefix}loss": loss, f"{prefix}perplexity": math.exp(min(loss, 50.0))}


def set_accumulation(engine, micro_batches: int) -> None:
    """Make DeepSpeed's accumulation steps (and its train_batch_size) this step's: a ramp-up stage changes them."""
    if engine.gradient_accumulation_steps() != micro_batches:
        engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * micro_batches * engine.dp_world_size)


def rampup_lr_factor(batches: StepBatches, data_step: int, settings: LoopSettings) -> float:
    """(this step's global batch / the full batch) ** the --rampup_lr_scaling exponent (1 without a ramp-up)."""
    return (batches.order.global_batch_at(data_step) / batches.order.global_batch) ** settings.rampup_lr_exponent


@contextmanager
def scaled_lr(engine, factor: float):
    """The update inside runs with the LR times `factor` (--rampup_lr_scaling). The schedule sets the next step's
    LR from its own base after an applied update; after a skipped one (no scheduler step) the scaling is undone."""
    if factor == 1.0:
        yield
        return
    groups = engine.lr_scheduler.optimizer.param_groups  # the dicts the schedule writes and the optimizer reads
    unscaled = [group["lr"] for group in groups]
    for group, lr in zip(groups, unscaled, strict=True):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        if not engine.was_step_applied():
            for group, lr in zip(groups, unscaled, strict=True):
                group["lr"] = lr


def _forward_backward(
    engine, batch: dict, scale: float, clock: PhaseClock, router_loss=None, micro_batches: int = 1, objective=None
) -> tuple:
    """One micro-batch: the backward of its share of the step's objective; (its summed token loss, its
    load-balancing loss or 0, a preference objective's metric sums or None), detached."""
    metrics = None
    if objective is not None:  # preference pairs: the summed per-pair loss (targets_in counted the pairs)
        summed, metrics = objective(engine, batch)
        aux, objective_value = 0.0, summed * scale
    elif router_loss is None:
        summed = token_loss_sum(engine, batch)  # looked up at each call: tests/helpers/inject_nonfinite.py wraps it
        aux, objective_value = 0.0, summed * scale
    else:  # the module docstring derives the aux factor
        summed, aux = token_and_router_losses(engine, batch, router_loss)
        objective_value = summed * scale + aux * (router_loss.coef / micro_batches)
        aux = aux.detach()
    clock.lap("forward")
    engine.backward(objective_value, scale_wrt_gas=False)
    clock.lap("backward")
    return summed.detach(), aux, metrics


def _logged(step: int, settings: LoopSettings) -> bool:
    """Whether step `step` (1-based) ends a logging window (a preemption's record is the exception: its step is not
    known in advance, and on a GPU its window may hold no step split into phases)."""
    return step % settings.logging_steps == 0 or step == settings.max_steps


def _count_step(
    state: TrainState, result: StepResult, guard: NonFiniteGuard | None, sample_ids: Callable[[], list]
) -> str:
    """Book the step in the train state; the guard's verdict ("ok", "skipped" or "rollback")."""
    state.step += 1
    state.samples_seen += result.blocks
    verdict = (
        "ok"
        if guard is None
        else guard.after_step(state.step, result.global_loss, result.forced, result.applied, sample_ids)
    )
    if not result.applied:
        state.skipped_steps += 1
    else:
        state.tokens_seen += result.targets if result.tokens is None else result.tokens
    return verdict


def _log_window(
    engine, window: LogWindow, bar, state: TrainState, settings: LoopSettings, hooks: LoopHooks, batches: StepBatches
) -> None:
    """The record of the steps since the last one (a collective: every rank calls it at the same step)."""
    summary = window.summarize(engine.device, settings.throughput)
    comms = hooks.comm_log.window() if hooks.comm_log else {}  # this rank's collectives since the last record
    if summary["loss"] is not None:
        bar.set_postfix(loss=f"{summary['loss']:.3f}")
    last_data_step = state.step - 1 + state.data_offset
    ramp = (
        {"lr_rampup_factor": rampup_lr_factor(batches, last_data_step, settings)} if settings.rampup_lr_exponent else {}
    )
    hooks.metrics.log(
        {
            "step": state.step,
            "epoch": round(state.samples_seen / len(batches.blocks), 4),
            "time": round(time.time(), 3),
            **summary,
            "lr": engine.get_lr()[0],
            **ramp,
            "global_batch": batches.order.global_batch_at(last_data_step),
            "tokens_seen": state.tokens_seen,
            "skipped_steps": state.skipped_steps,
            **comms,
        }
    )


def _save_for_preemption(step: int, settings: LoopSettings, hooks: LoopHooks, timers: StepTimers) -> None:
    seconds = timers.timed_save(hooks.save_now or hooks.save)  # a write in flight is committed first
    if hooks.ledger:  # no step follows to carry the save's time
        hooks.ledger.save_held(seconds)
    record_preemption_saved(step)  # for scaletrain.launcher, which may not see the ranks' exit code 85
    log.info(
        "preemption (%s): checkpoint committed at step %d in %.1fs",
        hooks.preemption.signal_name or "signal on another rank",
        step,
        seconds,
    )
    if seconds > settings.preemption_grace_seconds:
        log.warning(
            "the preemption save took %.1fs, more than --preemption_grace_seconds %.0f: ask the "
            "scheduler for an earlier signal",
            seconds,
            settings.preemption_grace_seconds,
        )


def _evaluate_when_due(engine, step: int, settings: LoopSettings, hooks: LoopHooks) -> None:
    started = time.perf_counter()
    due = settings.eval_steps and step % settings.eval_steps == 0
    if due and (hooks.eval_sets or hooks.generate is not None):
        _note(hooks, "evaluation", long=True)
    if hooks.eval_sets and due:
        hooks.metrics.log(
            {"step": step, **evaluate_sets(engine, hooks.eval_sets, hooks.pipeline or settings.objective)}
        )
    if hooks.generate is not None and due:
        hooks.generate(step)
    if hooks.ledger:
        hooks.ledger.evaluation(time.perf_counter() - started)


def _save_when_due(step: int, settings: LoopSettings, hooks: LoopHooks, timers: StepTimers, interval_due: bool) -> None:
    if interval_due or (settings.save_steps and step % settings.save_steps == 0):
        _note(hooks, "save", long=True)
        timers.timed_save(hooks.save)


def _note(hooks: LoopHooks, phase: str, step: int | None = None, long: bool = False) -> None:
    """Tell the hang watch where the loop is now (HangWatch.phase)."""
    if hooks.watch is not None:
        hooks.watch.phase(phase, step, long)
