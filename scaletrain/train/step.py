"""One optimizer step: the only place that calls engine.backward and engine.step (or engine.train_batch, which runs
both inside DeepSpeed's pipeline schedule).

Loss normalisation: a step's loss is the mean over every real target token of the global batch. Each micro-batch
contributes its *sum* of token losses over the global target count, so neither accumulation nor the number of ranks
changes the gradient (averaging per-micro-batch means is the Hugging Face accumulation bug). DeepSpeed averages
gradients over the D data-parallel ranks, so each rank multiplies by D to turn that average back into the global sum
(under sequence parallelism D is every rank: distributed/sequence_parallel.py); `scale_wrt_gas=False` stops DeepSpeed
dividing by the accumulation steps again. Preference runs (preference.py) do the same with pairs for tokens.

Mixture-of-experts models (model/moe.py) add the router's load-balancing loss: the objective is token-mean
cross-entropy + coef x aux, aux the mean of each micro-batch's own aux (transformers' per-batch statistic) over the
step's M micro-batches and D ranks. Each micro-batch's backward value is therefore

    loss_sum x D / global_targets + coef x aux / M

and DeepSpeed's average over the D ranks turns sum_ranks sum_micro (coef x aux / M) / D into coef x mean(aux), as it
turns the first term into the global token mean. The logged `loss` stays the cross-entropy alone, so runs with and
without MoE compare; `aux_loss` is the step's mean aux, not times coef; evaluation reports cross-entropy.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from scaletrain.data import EvalBatches, StepBatches
from scaletrain.train.losses import token_and_router_losses, token_loss_sum
from scaletrain.train.settings import LoopSettings

if TYPE_CHECKING:
    import torch

    from scaletrain.distributed import TokenLoss
    from scaletrain.engine import SkipSwitch
    from scaletrain.observability import PhaseClock


def agree_step(device, loss_sum, *flags: bool) -> tuple:
    """(global summed loss, *flags true on any rank): one all-reduce (SUM) at the step boundary, every rank.
    Decisions that depend on a rank's own view (a signal, its clock, its batch's loss) pass through here, or ranks
    would decide differently and hang in the next collective.
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
class Agreement:
    """What every rank agreed at a step boundary, before the update."""

    global_loss: float  # every rank's summed losses over the global batch's targets
    forced: str | None  # why a callback vetoed the update, or None
    requests: frozenset  # what some rank asked of every rank (callbacks.REQUESTS)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, as the loop books it."""

    loss_sum: torch.Tensor | float  # this rank's summed token losses (a device tensor: no host sync per step)
    targets: int  # the global batch's loss targets
    blocks: int  # the global batch's blocks
    agreed: Agreement
    applied: bool  # the update happened (DeepSpeed also refuses one whose gradient norm is not finite)
    # MoE: this rank's share of the step's mean load-balancing loss (summed over ranks: the mean)
    aux_share: torch.Tensor | float | None = None
    metric_sums: dict | None = None  # a preference step's metric sums on this rank (over ranks / targets: the mean)
    tokens: int | None = None  # tokens the step processed where they are not its targets (preference pairs)

    @property
    def global_loss(self) -> float:
        return self.agreed.global_loss

    @property
    def forced(self) -> str | None:
        return self.agreed.forced


@dataclass(frozen=True)
class StepBoundary:
    """What a step gets from the loop that runs it, and all it gets: the clock its phases lap, and the step-boundary
    agreement the loop runs on every rank (the global loss, the callbacks' requests and vetoes) once the gradients
    are in and before the update. The step knows no trainer: it returns what happened."""

    clock: PhaseClock
    agree: Callable[[torch.Tensor | float, int], Agreement]  # (this rank's summed loss, the step's targets)


def optimizer_step(
    engine,
    batches: StepBatches,
    *,
    data_step: int,
    settings: LoopSettings,
    boundary: StepBoundary,
    switch: SkipSwitch | None,
) -> StepResult:
    """One optimizer step on the global batch of `data_step` (0-based): every micro-batch's forward and backward,
    the step-boundary agreement (`boundary.agree`), then the update at the accumulation boundary (skipped on every
    rank through `switch` when the agreement vetoed it)."""
    clock = boundary.clock
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
    *accumulating, last = micro_batches
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
    summed, aux, metrics = backward(last)
    metric_sums = _add_sums(metric_sums, metrics)
    loss_sum = (loss_sum + summed) * settings.loss_share
    aux_share = (
        None
        if settings.router_loss is None
        else (aux_sum + aux) * settings.loss_share / (len(micro_batches) * settings.gradient_divisor)
    )
    agreed = boundary.agree(loss_sum, targets)  # the global loss (for the non-finite guard) and the requests
    if switch:
        switch.skip = agreed.forced is not None
    clock.lap("sync")
    with scaled_lr(engine, rampup_lr_factor(batches, data_step, settings)):
        engine.step()  # the update, at the accumulation boundary
    clock.lap("optimizer")
    if switch:
        switch.skip = False
        if agreed.forced is not None:
            switch.confirm_skipped(engine)
    return StepResult(
        loss_sum,
        targets,
        blocks,
        agreed,
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

    def __init__(self, engine, loss: TokenLoss, switch: SkipSwitch | None = None):
        from scaletrain.engine import before_pipeline_update, time_pipeline_instructions

        self.loss = loss  # the pipe engine's loss_fn
        self.switch = switch
        self._before_update: Callable[[], None] | None = None
        before_pipeline_update(engine, self._agree)
        self.times = time_pipeline_instructions(engine)  # the training schedules' waits and passes (the bubble)

    def _agree(self) -> None:
        if self._before_update is not None:
            self._before_update()

    def step(
        self, engine, batches: StepBatches, *, data_step: int, settings: LoopSettings, boundary: StepBoundary
    ) -> StepResult:
        from scaletrain.distributed import pipe_micro_batches

        clock, switch = boundary.clock, self.switch
        micro_batches, targets, blocks = batches.for_step(data_step)
        clock.lap("data_wait")
        set_accumulation(engine, len(micro_batches))
        # The pipe engine divides each micro-batch's backward by the accumulation steps: fold them back in.
        self.loss.scale = settings.gradient_divisor * len(micro_batches) / max(targets, 1)
        self.loss.loss_sum = 0.0
        agreed: list = []

        def before_update() -> None:  # the last stage holds the losses (once per tensor group); the rest add 0
            clock.lap("pipeline")
            agreed.append(boundary.agree(self.loss.loss_sum * settings.loss_share, targets))
            if switch:
                switch.skip = agreed[0].forced is not None
            clock.lap("sync")

        self._before_update = before_update
        self.times.active = True
        try:  # the LR is read only by the update at the schedule's end: scaling it around the whole batch is exact
            with scaled_lr(engine, rampup_lr_factor(batches, data_step, settings)):
                engine.train_batch(data_iter=iter(pipe_micro_batches(micro_batches)))
        finally:
            self.times.active = False
            self._before_update = None
            if switch:
                switch.skip = False
        if switch and agreed[0].forced is not None:
            switch.confirm_skipped(engine)
        clock.lap("optimizer")
        loss_sum = self.loss.loss_sum * settings.loss_share
        return StepResult(loss_sum, targets, blocks, agreed[0], applied=engine.was_step_applied())

    def evaluate(self, engine, batches: EvalBatches, prefix: str = "eval_") -> dict:
        """Mean loss over the evaluation blocks through the pipe's inference schedule, across ranks."""
        import deepspeed.comm as ds_comm
        import torch

        from scaletrain.distributed import pipe_micro_batches

        self.loss.scale, self.loss.loss_sum = 1.0, 0.0
        # The stages agree on an activation's shape once per schedule, so each run of equal-shaped batches (the last
        # may be smaller) is its own eval_batch; batches are built from the store as the schedule reads them.
        for _, same_shape in itertools.groupby(range(len(batches)), key=batches.rows):
            group = list(same_shape)
            engine.reset_activation_shape()
            engine.eval_batch(
                data_iter=(pipe_micro_batches([batches[i]])[0] for i in group), num_micro_batches=len(group)
            )
        engine.reset_activation_shape()
        engine.train()
        sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
        # One rank per data-parallel replica counts its batches (the tensor ranks of the last stage hold one loss).
        if engine.is_last_stage() and engine.grid.get_slice_parallel_rank() == 0:
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


PROBE_TOKENS = 8  # the probe's micro-batch: one sequence this short, whose FLOPs are negligible beside its fixed cost


def micro_batch_fixed_seconds(engine, repeats: int = 3) -> float:
    """The part of a micro-batch's forward and backward that does not grow with its tokens: operator dispatch,
    kernel launches, DeepSpeed's per-parameter gradient hooks. Measured as the median time of `repeats` micro-batches
    of one PROBE_TOKENS-token sequence, after one that warms up, each with its boundary reduction (as a step's last
    micro-batch). Run after the last step only: the gradients it leaves are never stepped, the run's state is saved
    already. Every rank runs it (the model's and the reduction's collectives); --plan_calibration reads it."""
    import statistics

    import torch
    from deepspeed.accelerator import get_accelerator

    ids = torch.arange(PROBE_TOKENS).unsqueeze(0)
    batch = {"input_ids": ids, "labels": ids}
    engine.train()
    times = []
    for _ in range(repeats + 1):
        get_accelerator().synchronize()
        started = time.perf_counter()
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(token_loss_sum(engine, batch), scale_wrt_gas=False)
        get_accelerator().synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
