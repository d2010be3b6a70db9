"""The trainer: the loop over optimizer steps. It drives the engine and the data (through a step runner, step.py),
counts each step in the train state, and calls its callbacks at fixed points (callbacks.py); every side concern
of a run is one of them, so the loop names none.

Loss normalisation and the step itself: scaletrain/train/step.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from scaletrain.data import StepBatches
from scaletrain.observability import PhaseClock
from scaletrain.train import step as steps
from scaletrain.train.callbacks import REQUESTS, Callback, RolledBack, StepOutcome
from scaletrain.train.settings import LoopSettings
from scaletrain.train.state import TrainState
from scaletrain.train.step import Agreement, PipelineStep, StepBoundary, StepResult, agree_step

if TYPE_CHECKING:
    from scaletrain.engine import SkipSwitch


class EngineStep:
    """The step runner without pipeline parallelism: step.optimizer_step, looked up at each call (test helpers wrap
    it), with the switch that skips a vetoed update."""

    def __init__(self, switch: SkipSwitch | None = None):
        self.switch = switch

    def step(self, engine, batches: StepBatches, *, data_step: int, settings: LoopSettings, boundary: StepBoundary):
        return steps.optimizer_step(
            engine, batches, data_step=data_step, settings=settings, boundary=boundary, switch=self.switch
        )


class Trainer:
    """Trains until the settings' max_steps. Callbacks get this trainer as `trainer` and may call phase(), hold(),
    record_fields() and records() on it; `engine`, `batches`, `state` and `settings` are theirs to read. The step
    runner gets only a StepBoundary (the clock and the agreement), never the trainer."""

    def __init__(
        self,
        engine,
        *,
        batches: StepBatches,
        state: TrainState,
        settings: LoopSettings,
        runner: EngineStep | PipelineStep,
        callbacks: Sequence[Callback],
    ):
        self.engine, self.batches, self.state, self.settings = engine, batches, state, settings
        self.runner = runner
        self.callbacks = tuple(sorted(callbacks, key=lambda callback: callback.order))  # stable: ties keep theirs
        self.clock = PhaseClock(engine.device)
        self._held = 0.0  # seconds saves held the loop since the step in flight began
        self._held_eval = 0.0  # seconds evaluations held it
        for callback in self.callbacks:
            callback.trainer = self

    def fit(self, finish: bool = True) -> None:
        """The loop, then (`finish`) the callbacks' end of training. A planned end that a callback raises (an
        errors.RunEnded) ends it after its step, with no end of training."""
        self.engine.train()
        self._call("pre_train")
        try:
            try:
                self._loop()
            finally:
                self._call("post_train")
            if finish:
                self.phase("end of run: evaluation, save, export", long=True)
                self._call("end_of_training", self.state.step)
        finally:
            self.callbacks = ()  # they hold this trainer, and it the engine: no cycle outlives the loop

    def _loop(self) -> None:
        first = True  # the first step of an attempt (compiles, warms up) has the long allowance
        while self.state.step < self.settings.max_steps:
            self.phase("forward/backward", self.state.step + 1, long=first)
            first = False
            outcome = self._step()
            try:
                self._call("post_step", outcome)
            except RolledBack:
                self._call("on_rollback", self.state.step)

    def _step(self) -> StepOutcome:
        step = self.state.step + 1
        self._call("pre_step", step)
        started = time.perf_counter()
        self.clock.start(measured=self.logged(step))  # a GPU synchronises per phase only in the logged steps
        data_step = self.state.step + self.state.data_offset  # rollbacks jump the data past offending batches
        boundary = StepBoundary(clock=self.clock, agree=self.agree)
        result = self.runner.step(
            self.engine, self.batches, data_step=data_step, settings=self.settings, boundary=boundary
        )
        count_step(self.state, result)
        # A save's or an evaluation's time joins the next step's, whose record follows it (the step profile's
        # "checkpoint" and "evaluation" phases).
        held, self._held = self._held, 0.0
        evaluated, self._held_eval = self._held_eval, 0.0
        self.clock.phases["checkpoint"] += held
        self.clock.phases["evaluation"] += evaluated
        return StepOutcome(
            step=step,
            data_step=data_step,
            result=result,
            seconds=time.perf_counter() - started + held + evaluated,
            phases=self.clock.phases if self.clock.measured else None,
            held=held,
            evaluated=evaluated,
            last=step == self.settings.max_steps,
            requests=result.agreed.requests,
        )

    def logged(self, step: int) -> bool:
        """Whether step `step` (1-based) ends a logging window (known before it runs)."""
        return step % self.settings.logging_steps == 0 or step == self.settings.max_steps

    def agree(self, loss_sum, targets: int) -> Agreement:
        """The step boundary, every rank: one all-reduce of the loss and of what each rank requests, then the
        callbacks' vetoes on the agreed global loss (the same on every rank, so the same verdict). The step calls it
        (through its StepBoundary) once its gradients are in; the update follows."""
        self.phase("step-boundary all-reduce")
        asked = set().union(*(callback.requests() for callback in self.callbacks))
        assert asked <= set(REQUESTS), asked - set(REQUESTS)
        total, *flags = agree_step(self.engine.device, loss_sum, *(name in asked for name in REQUESTS))
        global_loss = total / max(targets, 1)
        forced = next(
            (reason for callback in self.callbacks if (reason := callback.veto_update(global_loss)) is not None), None
        )
        self.phase("optimizer update")
        return Agreement(global_loss, forced, frozenset(name for name, on in zip(REQUESTS, flags, strict=True) if on))

    def phase(self, name: str, step: int | None = None, long: bool = False) -> None:
        """Tell the callbacks where the loop is now."""
        self._call("on_phase", name, step, long)

    def hold(self, kind: str, work: Callable[[], object]) -> float:
        """Run work that holds the loop ("checkpoint": a save; "evaluation"), whose time joins the next step's; its
        seconds."""
        started = time.perf_counter()
        work()
        seconds = time.perf_counter() - started
        if kind == "checkpoint":
            self._held += seconds
        else:
            self._held_eval += seconds
        self._call("on_hold", kind, seconds)
        return seconds

    def record_fields(self) -> dict:
        """What the callbacks add to a training record."""
        fields: dict = {}
        for callback in self.callbacks:
            fields.update(callback.record_fields())
        return fields

    def records(self, record: dict) -> None:
        """A training record was logged: every callback hears of it."""
        self._call("on_record", record)

    def _call(self, method: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, method)(*args)


def count_step(state: TrainState, result: StepResult) -> None:
    """Book the step in the train state."""
    state.step += 1
    state.samples_seen += result.blocks
    if not result.applied:
        state.skipped_steps += 1
    else:
        state.tokens_seen += result.targets if result.tokens is None else result.tokens
