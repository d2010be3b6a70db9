"""The trainer's loop and its callbacks, in-process: the order of the events, what a rollback, a hold and a planned
end do, and the contract tests/helpers/inject_nonfinite.py relies on.

The optimizer step itself runs in the real multi-rank tests (test_nonfinite.py, test_pipeline.py); here a stand-in
runner returns steps as the real one books them (the loop under test, not the engine)."""

from __future__ import annotations

import inspect
import math
import re
import time
from pathlib import Path

import pytest
import torch

from scaletrain.errors import Preempted
from scaletrain.observability.metrics import PHASES, PhaseClock
from scaletrain.train import step as steps
from scaletrain.train import trainer as trainer_module
from scaletrain.train.callbacks import Callback, Order, RolledBack, StepOutcome
from scaletrain.train.log_window import LogWindow
from scaletrain.train.nonfinite import NonFiniteGuard, NonFinitePolicy
from scaletrain.train.settings import LoopSettings
from scaletrain.train.state import TrainState
from scaletrain.train.step import Agreement, StepResult
from scaletrain.train.trainer import EngineStep, Trainer, count_step
from tests.helpers import inject_nonfinite


def result(applied=True, forced=None, loss=2.0, requests=()) -> StepResult:
    return StepResult(
        loss_sum=torch.tensor(loss * 100),
        targets=100,
        blocks=8,
        agreed=Agreement(loss, forced, frozenset(requests)),
        applied=applied,
    )


class Engine:
    """A stand-in for the engine's few calls the loop makes itself."""

    device = torch.device("cpu")

    def train(self) -> None:
        pass


class Runner:
    """A stand-in step runner: each step's result from a list, after a phase note, as the real step makes one."""

    def __init__(self, results: list):
        self.results = list(results)

    def step(self, engine, batches, *, data_step, settings, boundary):
        boundary.clock.lap("data_wait")
        return self.results.pop(0)


class Recorder(Callback):
    def __init__(self, events: list, name: str = "r"):
        self.events, self.name = events, name

    def pre_train(self):
        self.events.append((self.name, "pre_train"))

    def on_phase(self, phase, step, long):
        self.events.append((self.name, "phase", phase, step, long))

    def pre_step(self, step):
        self.events.append((self.name, "pre_step", step))

    def post_step(self, outcome):
        self.events.append((self.name, "post_step", outcome.step, outcome.last, sorted(outcome.requests)))

    def on_rollback(self, step):
        self.events.append((self.name, "rollback", step))

    def on_hold(self, kind, seconds):
        self.events.append((self.name, "hold", kind))

    def post_train(self):
        self.events.append((self.name, "post_train"))


def settings(max_steps=3, logging_steps=2) -> LoopSettings:
    return LoopSettings(max_steps=max_steps, logging_steps=logging_steps, gradient_divisor=1)


def test_every_callback_hears_each_event_in_the_lists_order_and_the_loop_counts_the_steps():
    events: list = []
    state = TrainState()
    runner = Runner([result(), result(applied=False), result(requests=("save",))])
    trainer = Trainer(
        Engine(),
        batches=None,
        state=state,
        settings=settings(),
        runner=runner,
        callbacks=[Recorder(events, "a"), Recorder(events, "b")],
    )
    trainer.fit()
    assert (state.step, state.samples_seen, state.tokens_seen, state.skipped_steps) == (3, 24, 200, 1)
    first_step = [e for e in events if len(e) < 3 or e[2] in (1, "forward/backward", "optimizer update")][:12]
    assert first_step[:4] == [
        ("a", "pre_train"),
        ("b", "pre_train"),
        ("a", "phase", "forward/backward", 1, True),  # the first step of an attempt: the long allowance
        ("b", "phase", "forward/backward", 1, True),
    ]
    assert [e for e in events if e[1] == "post_step"] == [
        ("a", "post_step", 1, False, []),
        ("b", "post_step", 1, False, []),
        ("a", "post_step", 2, False, []),
        ("b", "post_step", 2, False, []),
        ("a", "post_step", 3, True, ["save"]),
        ("b", "post_step", 3, True, ["save"]),
    ]
    assert ("a", "phase", "forward/backward", 2, False) in events
    assert events[-4:] == [  # the loop's end, then the end of training's phase
        ("a", "post_train"),
        ("b", "post_train"),
        ("a", "phase", "end of run: evaluation, save, export", None, True),
        ("b", "phase", "end of run: evaluation, save, export", None, True),
    ]
    assert trainer.logged(2) and trainer.logged(3) and not trainer.logged(1)


def test_the_step_boundary_names_its_all_reduce_then_the_update_and_applies_the_vetoes(monkeypatch):
    """The step reaches the trainer only through its StepBoundary: agree() runs the all-reduce (here a one-rank
    stand-in of agree_step, the real one needs a process group), names the two phases in order, and returns the
    callbacks' verdict on the agreed loss with the requests some rank made."""

    class Veto(Recorder):
        def veto_update(self, global_loss):
            return "too high" if global_loss > 1.0 else None

        def requests(self):
            return ("save",)

    monkeypatch.setattr(trainer_module, "agree_step", lambda device, loss_sum, *flags: (float(loss_sum), *flags))
    seen: list = []

    class AgreeingRunner(Runner):
        def step(self, engine, batches, *, data_step, settings, boundary):
            seen.append(boundary.agree(torch.tensor(300.0), 100))  # global loss 3.0
            return super().step(engine, batches, data_step=data_step, settings=settings, boundary=boundary)

    events: list = []
    trainer = Trainer(
        Engine(),
        batches=None,
        state=TrainState(),
        settings=settings(max_steps=1),
        runner=AgreeingRunner([result()]),
        callbacks=[Veto(events)],
    )
    trainer.fit(finish=False)
    phases = [e[2] for e in events if e[1] == "phase"]
    assert phases[1:3] == ["step-boundary all-reduce", "optimizer update"]  # after the step's forward/backward
    assert seen == [Agreement(3.0, "too high", frozenset({"save"}))]


def test_callbacks_act_in_their_declared_order_whatever_order_they_are_listed_in():
    """The trainer orders its callbacks by each one's declared Order, not by list position: the export listed first
    and the checkpoints listed before the records they must follow still act after them."""
    events: list = []

    def recorder(name: str, order: Order) -> Recorder:
        kind = type(f"Recorder_{name}", (Recorder,), {"order": order})
        return kind(events, name)

    listed = [
        recorder("export", Order.EXPORT),
        recorder("checkpoints", Order.CHECKPOINTS),
        recorder("records", Order.TRAINING_RECORDS),
        recorder("guard", Order.NONFINITE_GUARD),
        recorder("evaluation", Order.EVALUATION),
    ]
    trainer = Trainer(
        Engine(),
        batches=None,
        state=TrainState(),
        settings=settings(max_steps=1),
        runner=Runner([result()]),
        callbacks=listed,
    )
    expected = ["guard", "records", "evaluation", "checkpoints", "export"]
    assert [c.name for c in trainer.callbacks] == expected
    trainer.fit()
    assert [e[0] for e in events if e[1] == "post_step"] == expected
    assert [e[0] for e in events if e[1] == "pre_train"] == expected


def test_the_run_s_callbacks_declare_the_order_the_loop_relies_on():
    """The real concerns' declared orders: the guard's verdict before the step's record, the record before
    evaluation, evaluation before the checkpoint callback (its commit and saves), the export last."""
    from scaletrain.checkpoint import Checkpointing, FinalExport
    from scaletrain.train import (
        BenchmarkEvaluation,
        GoodputBook,
        HangNotes,
        PeriodicEvaluation,
        ProgressBar,
        StepProfiler,
        TrainingRecords,
    )

    sequence = [
        HangNotes,
        NonFiniteGuard,
        GoodputBook,
        StepProfiler,
        ProgressBar,
        TrainingRecords,
        PeriodicEvaluation,
        BenchmarkEvaluation,
        Checkpointing,
        FinalExport,
    ]
    orders = [kind.order for kind in sequence]
    assert orders == sorted(orders) and len(set(orders)) == len(orders), dict(zip(sequence, orders, strict=True))


def test_a_rollback_skips_the_rest_of_its_step_and_every_callback_hears_it():
    events: list = []
    state = TrainState()

    class RollsBackAtStep2(Callback):
        done = False

        def post_step(self, outcome):
            if outcome.step == 2 and not self.done:
                self.done, state.step = True, 1  # as a checkpoint load would
                raise RolledBack

    callbacks = [Recorder(events, "a"), RollsBackAtStep2(), Recorder(events, "b")]
    trainer = Trainer(
        Engine(),
        batches=None,
        state=state,
        settings=settings(max_steps=2),
        runner=Runner([result()] * 3),
        callbacks=callbacks,
    )
    trainer.fit()
    posts = [e[:3] for e in events if e[1] in ("post_step", "rollback")]
    assert posts == [
        ("a", "post_step", 1),
        ("b", "post_step", 1),
        ("a", "post_step", 2),  # b never sees step 2: it was undone
        ("a", "rollback", 1),
        ("b", "rollback", 1),
        ("a", "post_step", 2),
        ("b", "post_step", 2),
    ]


def test_a_planned_end_ends_the_loop_after_its_callbacks_post_train():
    events: list = []

    class Stops(Callback):
        def post_step(self, outcome):
            if "stop" in outcome.requests:
                raise Preempted(outcome.step)

    runner = Runner([result(), result(requests=("stop",)), result()])
    trainer = Trainer(
        Engine(),
        batches=None,
        state=TrainState(),
        settings=settings(),
        runner=runner,
        callbacks=[Stops(), Recorder(events)],
    )
    with pytest.raises(Preempted):
        trainer.fit()
    assert [e[2] for e in events if e[1] == "post_step"] == [1]
    assert events[-1] == ("r", "post_train")  # the bar closes, the ledger books, however the loop ended


def test_a_saves_time_joins_the_next_steps_and_each_hold_is_heard():
    events: list = []

    class SavesAfterStep1(Callback):
        def post_step(self, outcome):
            if outcome.step == 1:
                self.trainer.hold("checkpoint", lambda: time.sleep(0.05))
                self.trainer.hold("evaluation", lambda: time.sleep(0.01))
            events.append((outcome.step, outcome.held, outcome.seconds, outcome.phases["checkpoint"]))

    trainer = Trainer(
        Engine(),
        batches=None,
        state=TrainState(),
        settings=settings(max_steps=3),
        runner=Runner([result()] * 3),
        callbacks=[],
    )
    trainer.callbacks = (SavesAfterStep1(), Recorder(events))
    for callback in trainer.callbacks:
        callback.trainer = trainer
    trainer.fit()
    outcomes = [e for e in events if isinstance(e[0], int)]
    assert outcomes[0][1] == 0.0
    step2 = outcomes[1]
    assert step2[1] >= 0.05 and step2[2] >= step2[1] and step2[3] == step2[1]  # the save, not the evaluation
    assert outcomes[2][1] == 0.0  # counted once
    assert [e[2] for e in events if e[1] == "hold"] == ["checkpoint", "evaluation"]


def test_count_step_books_applied_and_skipped_steps():
    state = TrainState()
    count_step(state, result())
    assert (state.step, state.samples_seen, state.tokens_seen, state.skipped_steps) == (1, 8, 100, 0)
    count_step(state, result(applied=False, forced="nonfinite_loss", loss=math.nan))
    assert (state.step, state.samples_seen, state.tokens_seen, state.skipped_steps) == (2, 16, 100, 1)


def test_the_train_state_keeps_its_layout_as_checkpoints_have_always_recorded_it():
    """One layout type: the state holds the ParallelLayout; a checkpoint's train_state keeps the sizes under their
    old names (world_size the data-parallel ranks), so older checkpoints and the resume checks read it unchanged."""
    from scaletrain.parts import ParallelLayout

    state = TrainState(step=7)
    assert state.state_dict()["world_size"] == 0 and state.layout is None  # not recorded yet
    state.record_layout(ParallelLayout(tp=2, pp=2, dp=3), 1, "optimizer=none,param=none")
    saved = state.state_dict()
    assert (saved["world_size"], saved["tensor_parallel_size"], saved["pipeline_parallel_size"]) == (3, 2, 2)
    assert saved["sequence_parallel_size"] == 1 and saved["stage_splits_recorded"] is True and "layout" not in saved
    restored = TrainState()
    restored.load_state_dict(saved)
    assert restored == state
    older = TrainState()  # a state saved before the sequence and pipeline sizes were kept
    older.load_state_dict({"step": 3, "world_size": 4, "tensor_parallel_size": 2})
    assert older.layout == ParallelLayout(tp=2, dp=4) and older.step == 3


def test_the_guard_vetoes_a_nonfinite_loss_and_rolls_back_after_its_streak(tmp_path):
    state = TrainState()
    entries = []
    guard = NonFiniteGuard(
        NonFinitePolicy("skip", 2, 0.0, False), state, str(tmp_path), is_main=True, rollback=lambda: {"event": "x"}
    )
    guard.record = entries.append
    assert guard.veto_update(math.nan) == "nonfinite_loss" and guard.veto_update(2.0) is None

    class Batches:
        def sample_ids(self, data_step):
            return [data_step]

    bad = result(applied=False, forced="nonfinite_loss", loss=math.nan)
    trainer = Trainer(
        Engine(),
        batches=Batches(),
        state=state,
        settings=settings(max_steps=5),
        runner=Runner([bad, bad]),
        callbacks=[guard],
    )
    with pytest.raises(RolledBack):  # the second skip in a row: back to the checkpoint, its entry in the ledger
        for _ in range(2):
            outcome = trainer._step()
            guard.post_step(outcome)
    assert [e.get("samples") for e in entries] == [[0], [1], None] and entries[-1] == {"event": "x"}


def test_the_loops_module_names_no_side_concern():
    source = Path(trainer_module.__file__).read_text().lower()
    names = ("ledger", "goodput", "metrics", "profiler", "watch", "hang", "comm", "preempt", "nonfinite", "guard")
    named = [name for name in names if re.search(rf"\b{name}", source)]
    assert not named, named


def test_the_inject_spec_reads_rank_steps_and_factors():
    assert inject_nonfinite.parse_spec("0:12x50") == (0, {12: 50.0})
    rank, factors = inject_nonfinite.parse_spec("1:5,6x2.5,7")
    assert rank == 1 and factors[6] == 2.5 and sorted(factors) == [5, 6, 7]
    assert math.isnan(factors[5]) and math.isnan(factors[7])


def test_the_injection_scales_the_loss_only_inside_the_optimizer_step_of_its_data_step(monkeypatch):
    # The helper patches these two names; the runner must look them up at call time, and the step take data_step.
    assert "optimizer_step" in EngineStep.step.__code__.co_names
    assert "token_loss_sum" in steps._forward_backward.__code__.co_names
    params = list(inspect.signature(steps.optimizer_step).parameters)
    assert "data_step" in params

    def step_standin(engine, batches, *, data_step, settings, boundary, switch):
        return steps.token_loss_sum(engine, batches)

    assert list(inspect.signature(step_standin).parameters) == params
    monkeypatch.setattr(steps, "optimizer_step", step_standin)
    monkeypatch.setattr(steps, "token_loss_sum", lambda engine, batch: torch.tensor(2.0))
    from scaletrain.distributed import pipeline

    # install() wraps the pipeline's step and loss too: put them back after this test
    monkeypatch.setattr(steps.PipelineStep, "step", steps.PipelineStep.step)
    monkeypatch.setattr(pipeline.TokenLoss, "__call__", pipeline.TokenLoss.__call__)
    inject_nonfinite.install({5: 10.0, 7: math.nan})
    runner = EngineStep()

    def step(data_step):
        return runner.step(None, None, data_step=data_step, settings=None, boundary=None)

    assert step(4).item() == 20.0  # data step 5 (1-based)
    assert step(5).item() == 2.0
    assert math.isnan(step(6).item())
    assert steps.token_loss_sum(None, None).item() == 2.0  # an evaluation outside the step is untouched


def test_the_loop_holds_no_test_hook():
    for module in (steps, trainer_module):
        source = Path(module.__file__).read_text()
        assert "inject" not in source.replace("inject_nonfinite.py", "").lower()
        assert "SCALETRAIN_TEST" not in source and "os.environ" not in source


@pytest.mark.parametrize("module", ["scaletrain.train.preemption", "scaletrain.train.step"])
def test_no_injection_names_remain_in_the_pipeline(module):
    imported = __import__(module, fromlist=["_"])
    assert not hasattr(imported, "injected_loss_factor") and not hasattr(imported, "TEST_INJECT_ENV")


def test_on_a_gpu_only_logged_steps_synchronise_and_their_phases_are_what_is_reported():
    """A CUDA device without a GPU: a stand-in device object of type "cuda" and a counting synchronize (the logic,
    not CUDA, is under test here). Unlogged steps synchronise never; a logged step at its start and every lap."""
    calls = []
    clock = PhaseClock(type("Device", (), {"type": "cuda"})(), synchronize=lambda: calls.append(1))
    clock.start(measured=False)
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        clock.lap(phase)
    assert calls == [] and not clock.measured and set(clock.phases.values()) == {0.0}
    clock.start(measured=True)
    clock.lap("data_wait")
    time.sleep(0.02)
    clock.lap("forward")
    assert len(calls) == 3 and clock.phases["forward"] >= 0.02
    # the window reports the mean over the steps split into phases, not over every step
    window = LogWindow()
    split = {**dict.fromkeys(PHASES, 0.0), "forward": 0.3}
    for phases in (None, split):
        window.add(StepOutcome(1, 0, result(), 0.5, phases, held=0.0, last=False), None)
    assert (window.steps, window.phase_steps, window.phases["forward"]) == (2, 1, 0.3)
    cpu = PhaseClock(torch.device("cpu"))
    cpu.start(measured=False)
    assert cpu.measured  # on a CPU every step is split: timing costs nothing there


def test_a_preemption_at_an_evaluation_step_saves_without_evaluating():
    """The signal's lead time is the save's: at the step the ranks agree on a preemption, an evaluation due is not
    run; at other steps it is."""
    from scaletrain.train.evaluation import PeriodicEvaluation

    evaluated: list = []

    class Metrics:
        def log(self, record):
            evaluated.append(record["step"])

    evaluation = PeriodicEvaluation(1, Metrics(), evaluate=lambda: {"eval_loss": 1.0})
    runner = Runner([result(), result(requests=("stop",)), result()])
    trainer = Trainer(
        Engine(),
        batches=None,
        state=TrainState(),
        settings=settings(max_steps=3),
        runner=runner,
        callbacks=[evaluation],
    )
    trainer.fit(finish=False)
    assert evaluated == [1]  # not step 2 (the preemption's), not step 3 (the last: the end of training's)


def test_the_end_of_training_evaluates_the_last_step_once_unless_it_has_its_records():
    """The last step is evaluated by the end of training, after the loop; a run resumed at its last step (already
    complete, its records written) runs no step and does not evaluate it again."""
    from scaletrain.train.evaluation import PeriodicEvaluation

    evaluated: list = []

    class Metrics:
        def __init__(self, done: set):
            self.done = done

        def log(self, record):
            evaluated.append(record["step"])

        def evaluated(self, step):
            return step in self.done

    def run(state: TrainState, done: set, steps: int) -> None:
        evaluation = PeriodicEvaluation(1, Metrics(done), evaluate=lambda: {"eval_loss": 1.0})
        trainer = Trainer(
            Engine(),
            batches=None,
            state=state,
            settings=settings(max_steps=2),
            runner=Runner([result()] * steps),
            callbacks=[evaluation],
        )
        trainer.fit()

    run(TrainState(), set(), steps=2)
    assert evaluated == [1, 2]  # step 1 by the loop, step 2 (the last) by the end of training
    evaluated.clear()
    resumed = TrainState()
    resumed.step = 2
    run(resumed, {1, 2}, steps=0)
    assert evaluated == []
