"""The interface between the training loop and its side concerns (metrics, the goodput ledger, the hang watch,
saves, evaluation, the non-finite guard, preemption). The loop drives the engine and the data; at fixed points it
calls every callback of one ordered list, the same on every rank, so that a callback that enters a collective (an
evaluation, a save) does so on every rank at the same step. The loop names no concern: it knows callbacks only.

Modelled on OLMo-core's trainer callbacks (src/olmo_core/train/callbacks/callback.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from scaletrain.train.step import StepResult
    from scaletrain.train.trainer import Trainer

# What a rank may ask of every rank at a step boundary: any rank's request holds on all of them (agreed in one
# all-reduce with the loss), because a rank's own view (a signal it got, its clock) differs from the others'.
REQUESTS = ("stop", "save")


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step, counted: what post_step receives."""

    step: int  # the step just done (1-based)
    data_step: int  # the global batch it trained on (0-based; past a rollback's skipped batches)
    result: StepResult
    seconds: float  # wall clock, including the time saves and evaluations held the loop since the step before
    phases: dict | None  # the step's split into phases (None: not split, a GPU step that is not logged)
    held: float  # the seconds of `seconds` that saves held the loop
    last: bool  # the run's last step: the end of the run evaluates and saves
    requests: frozenset = field(default_factory=frozenset)  # agreed at the step boundary (REQUESTS)
    evaluated: float = 0.0  # the seconds of `seconds` that evaluations held the loop

    @property
    def data_wait(self) -> float:
        return self.phases["data_wait"] if self.phases else 0.0


class RolledBack(Exception):
    """Raised by a post_step that took the run back to a checkpoint: the rest of that step's post_step calls are
    skipped, and every callback's on_rollback follows."""


class Order(IntEnum):
    """When each side concern acts, lowest first, at every hook: the trainer calls its callbacks in this order,
    whatever order they were listed in (callbacks of one order keep their list order, which none may depend on)."""

    HANG_NOTES = 10  # the hang watch hears of a phase before the other concerns start work in it
    NONFINITE_GUARD = 20  # its verdict (veto, skip, rollback) before anything records, evaluates or saves the step
    GOODPUT = 30
    PROFILER = 40
    OBSERVER = 60  # progress, communication and pipeline windows: they only watch
    TRAINING_RECORDS = 70  # the step's record before an evaluation, a save or a preemption save
    EVALUATION = 80  # evaluation before a periodic save of the same step
    BENCHMARKS = 90
    # The commit of a save in flight, the step's saves (periodic, then a preemption's: a save due at the preemption's
    # step is the one it commits, once); at the end the final checkpoint, after the last evaluation.
    CHECKPOINTS = 100
    EXPORT = 105  # at the end: the Hugging Face folder, from the saved run


class Callback:
    """A side concern of the loop. Every method does nothing unless overridden; `trainer` is set before pre_train;
    `order` places it among the others (Order)."""

    trainer: Trainer
    order: ClassVar[int] = Order.OBSERVER

    def pre_train(self) -> None:
        """Before the first step of this attempt."""

    def on_phase(self, phase: str, step: int | None, long: bool) -> None:
        """The loop is now in `phase` (at `step`, the 1-based step in flight); `long`: work that may take long."""

    def pre_step(self, step: int) -> None:
        """Step `step` (1-based) starts."""

    def requests(self) -> Collection[str]:
        """What this rank asks of every rank at this step boundary (names from REQUESTS)."""
        return ()

    def veto_update(self, global_loss: float) -> str | None:
        """Why this step's update must not be applied (on every rank: `global_loss` is agreed), or None."""
        return None

    def post_step(self, outcome: StepOutcome) -> None:
        """After the step is counted. May raise RolledBack, Preempted or another planned end of the run."""

    def on_rollback(self, step: int) -> None:
        """The run went back to its checkpoint of `step`; training continues from there."""

    def record_fields(self) -> dict:
        """Fields this concern adds to the next training record (called once per logging window on every rank)."""
        return {}

    def on_record(self, record: dict) -> None:
        """A training record was logged."""

    def on_hold(self, kind: str, seconds: float) -> None:
        """Work of `kind` ("checkpoint" or "evaluation") held the loop for `seconds`."""

    def post_train(self) -> None:
        """The loop ended, however it ended (its last step, a planned end such as a preemption, a crash)."""

    def end_of_training(self, step: int) -> None:
        """The run reached its last step, `step` (or was resumed there, already complete): the end's work, after
        post_train, on every rank (the last evaluation, the final checkpoint, the export). Not after a planned end
        such as a preemption, nor after a crash."""
