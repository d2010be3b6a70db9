"""Callbacks that watch the loop without changing what it trains: the training records (the log window and the
metrics sinks), the progress bar, the goodput ledger's bookkeeping, the hang watch's notes, the communication log's
window and the torch profiler's trace."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.train.callbacks import Callback, Order, StepOutcome
from scaletrain.train.log_window import LogWindow
from scaletrain.train.step import rampup_lr_factor

if TYPE_CHECKING:
    from scaletrain.engine import InstructionTimes
    from scaletrain.observability import CommLog, GoodputLedger, MetricsLogger, ThroughputModel
    from scaletrain.train.hang import HangWatch

log = logging.getLogger(__name__)


class TrainingRecords(Callback):
    """The log window: each step's loss, time and phases summed on this rank, and at each logging step (or a step
    that stops the run) one record of the window, reduced across ranks, to the metrics sinks. A collective: every
    rank writes a record at the same steps."""

    order = Order.TRAINING_RECORDS

    def __init__(self, metrics: MetricsLogger, throughput: ThroughputModel | None = None):
        self.metrics, self.throughput = metrics, throughput
        self.window = LogWindow()

    def post_step(self, outcome: StepOutcome) -> None:
        self.window.add(outcome, self.trainer.engine.get_global_grad_norm())
        if self.trainer.logged(outcome.step) or "stop" in outcome.requests:
            self._record(outcome.step)
            self.window = LogWindow()

    def on_rollback(self, step: int) -> None:
        self.window = LogWindow()
        self.metrics.rewind(step)  # the records after `step` are of steps that will be trained again

    def _record(self, step: int) -> None:
        trainer = self.trainer
        engine, batches, state, settings = trainer.engine, trainer.batches, trainer.state, trainer.settings
        summary = self.window.summarize(engine.device, self.throughput)
        fields = trainer.record_fields()  # read on every rank: each concern's window closes here
        last_data_step = state.step - 1 + state.data_offset
        ramp = (
            {"lr_rampup_factor": rampup_lr_factor(batches, last_data_step, settings)}
            if settings.rampup_lr_exponent
            else {}
        )
        record = {
            "step": state.step,
            "epoch": round(state.samples_seen / len(batches.blocks), 4),
            "time": round(time.time(), 3),
            **summary,
            "lr": engine.get_lr()[0],
            **ramp,
            "global_batch": batches.order.global_batch_at(last_data_step),
            "tokens_seen": state.tokens_seen,
            "skipped_steps": state.skipped_steps,
            **fields,
        }
        self.metrics.log(record)
        trainer.records(record)


class ProgressBar(Callback):
    """tqdm's bar of steps, with log lines printed above it (rank 0, unless --disable_tqdm)."""

    order = Order.OBSERVER

    def __init__(self, show: bool):
        self.show = show
        self._bar: Any = None  # tqdm's bar, opened at pre_train
        self._redirect = ExitStack()

    def pre_train(self) -> None:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        settings, state = self.trainer.settings, self.trainer.state
        self._bar = tqdm(
            total=settings.max_steps,
            initial=state.step,
            disable=not self.show,
            desc="training",
            unit="step",
            dynamic_ncols=True,
        )
        self._redirect.enter_context(logging_redirect_tqdm())

    def post_step(self, outcome: StepOutcome) -> None:
        self._bar.update(1)

    def on_record(self, record: dict) -> None:
        if record.get("loss") is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.3f}")

    def on_rollback(self, step: int) -> None:
        self._bar.reset(total=self.trainer.settings.max_steps)
        self._bar.update(step)

    def post_train(self) -> None:
        self._redirect.close()
        if self._bar is not None:
            self._bar.close()


class GoodputBook(Callback):
    """Books the loop's time in the goodput ledger: each step's, the data wait, saves and evaluations."""

    order = Order.GOODPUT

    def __init__(self, ledger: GoodputLedger):
        self.ledger = ledger
        self._unbooked_save = 0.0  # a save's seconds not yet booked with the step after it

    def pre_step(self, step: int) -> None:
        self.ledger.step_started()

    def post_step(self, outcome: StepOutcome) -> None:
        # (an evaluation's time, in the step's, is booked as eval by on_hold)
        self.ledger.step(outcome.step, outcome.seconds - outcome.evaluated, outcome.data_wait, outcome.held)
        self._unbooked_save = 0.0

    def on_rollback(self, step: int) -> None:
        self.ledger.rolled_back(step)

    def on_record(self, record: dict) -> None:
        self.ledger.write()  # so that a kill -9 loses at most a logging window of the ledger

    def on_hold(self, kind: str, seconds: float) -> None:
        if kind == "evaluation":
            self.ledger.evaluation(seconds)
        else:
            self._unbooked_save += seconds

    def post_train(self) -> None:
        if self._unbooked_save:  # a save no step followed (the preemption's, right before the exit)
            self.ledger.save_held(self._unbooked_save)
            self._unbooked_save = 0.0


class HangNotes(Callback):
    """Tells the hang watch where the loop is (an assignment or two: nothing is written from the loop)."""

    order = Order.HANG_NOTES

    def __init__(self, watch: HangWatch):
        self.watch = watch

    def on_phase(self, phase: str, step: int | None, long: bool) -> None:
        self.watch.phase(phase, step, long)


class CommsWindow(Callback):
    """--comms_log: this rank's collectives since the last record, in each training record."""

    order = Order.OBSERVER

    def __init__(self, comm_log: CommLog):
        self.comm_log = comm_log

    def record_fields(self) -> dict:
        return self.comm_log.window()


class PipelineBubble(Callback):
    """Under pipeline parallelism, each stage's bubble since the last record, measured: the seconds its ranks waited
    in the schedule's receives (for a neighbour stage: the fill and drain of 1F1B, and the transfers) over the seconds
    they spent in forward and backward passes, beside the schedule's own (stages - 1) / micro-batches."""

    order = Order.OBSERVER

    def __init__(self, times: InstructionTimes, stage: int, stages: int, micro_batches: Callable[[], int]):
        self.times, self.stage, self.stages, self.micro_batches = times, stage, stages, micro_batches

    def record_fields(self) -> dict:
        from scaletrain.distributed import all_gather_objects

        idle, busy = self.times.take()
        by_stage = [[0.0, 0.0] for _ in range(self.stages)]
        for stage, waited, worked in all_gather_objects((self.stage, idle, busy)):  # every rank, every record
            by_stage[stage][0] += waited
            by_stage[stage][1] += worked
        fields = {f"pipeline_bubble_stage{s}": waited / worked for s, (waited, worked) in enumerate(by_stage) if worked}
        return {**fields, "pipeline_bubble_expected": (self.stages - 1) / self.micro_batches()} if fields else {}


class StepProfiler(Callback):
    """--profile_steps A-B: a torch profiler trace of steps A..B (1-based), one Chrome trace per rank."""

    order = Order.PROFILER

    def __init__(self, steps: tuple | None, out_dir: str, rank: int):
        self.steps = steps
        self.out = Path(out_dir) / "profile"
        self.rank = rank
        self._prof: Any = None  # torch's profiler over steps A..B

    def pre_step(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities)
            self._prof.start()

    def post_step(self, outcome: StepOutcome) -> None:
        if self._prof is not None and self.steps is not None and outcome.step == self.steps[1]:
            self._prof.stop()
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / f"trace_rank{self.rank}_steps{self.steps[0]}-{self.steps[1]}.json"
            self._prof.export_chrome_trace(str(path))
            self._prof = None
            log.info("profiler trace of steps %d-%d: %s", self.steps[0], self.steps[1], path)
