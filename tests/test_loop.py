"""The loop's bookkeeping pieces, in-process, and the contract tests/helpers/inject_nonfinite.py relies on.

The optimizer step itself runs in the real multi-rank tests (test_nonfinite.py, test_pipeline.py)."""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path

import pytest
import torch

from scaletrain.train import loop
from scaletrain.train.loop import LoopSettings, StepResult, StepTimers, _count_step, _logged
from scaletrain.observability.metrics import PHASES, LogWindow, PhaseClock
from scaletrain.train.nonfinite import NonFiniteGuard, NonFinitePolicy
from scaletrain.train.state import TrainState
from tests.helpers import inject_nonfinite


def result(applied=True, forced=None, loss=2.0) -> StepResult:
    return StepResult(
        loss_sum=torch.tensor(loss * 100),
        targets=100,
        blocks=8,
        global_loss=loss,
        preempted=False,
        interval_due=False,
        forced=forced,
        applied=applied,
    )


def test_a_save_counts_in_the_next_step_and_the_interval_clock_restarts_with_it():
    timers = StepTimers(torch.device("cpu"), save_interval_minutes=0)
    assert not timers.save_due()  # 0: no interval saves
    seconds = timers.timed_save(lambda: time.sleep(0.05))
    assert seconds >= 0.05 and timers.pending_checkpoint == seconds
    timers.clock.start()
    started = time.perf_counter()
    step_seconds, phases = timers.close_step(started)
    assert phases["checkpoint"] == seconds and step_seconds >= seconds
    assert timers.close_step(time.perf_counter())[1]["checkpoint"] == seconds  # counted once, not again
    timers.clock.start()
    assert timers.close_step(time.perf_counter())[1]["checkpoint"] == 0.0
    hourly = StepTimers(torch.device("cpu"), save_interval_minutes=60)
    assert not hourly.save_due()
    hourly.last_save -= 3601
    assert hourly.save_due()
    hourly.timed_save(lambda: None)
    assert not hourly.save_due()


def test_count_step_books_applied_and_skipped_steps_and_passes_on_the_guards_verdict(tmp_path):
    state = TrainState()
    assert _count_step(state, result(), None, list) == "ok"
    assert (state.step, state.samples_seen, state.tokens_seen, state.skipped_steps) == (1, 8, 100, 0)
    guard = NonFiniteGuard(NonFinitePolicy("skip", 2, 0.0, False), state, str(tmp_path), is_main=True)
    bad = result(applied=False, forced="nonfinite_loss", loss=math.nan)
    assert _count_step(state, bad, guard, lambda: [3, 4]) == "skipped"
    assert (state.step, state.samples_seen, state.tokens_seen, state.skipped_steps) == (2, 16, 100, 1)
    assert _count_step(state, bad, guard, lambda: [5]) == "rollback"
    assert (state.step, state.skipped_steps) == (3, 2)


def test_the_inject_spec_reads_rank_steps_and_factors():
    assert inject_nonfinite.parse_spec("0:12x50") == (0, {12: 50.0})
    rank, factors = inject_nonfinite.parse_spec("1:5,6x2.5,7")
    assert rank == 1 and factors[6] == 2.5 and sorted(factors) == [5, 6, 7]
    assert math.isnan(factors[5]) and math.isnan(factors[7])


def test_the_injection_scales_the_loss_only_inside_the_optimizer_step_of_its_data_step(monkeypatch):
    # The helper patches these two names; the loop must look them up at call time, and the step must take data_step.
    assert "optimizer_step" in loop.train_loop.__code__.co_names
    assert "token_loss_sum" in loop._forward_backward.__code__.co_names
    params = list(inspect.signature(loop.optimizer_step).parameters)
    assert "data_step" in params

    def step_standin(engine, batches, data_step, settings, hooks, timers):
        return loop.token_loss_sum(engine, batches)

    assert list(inspect.signature(step_standin).parameters) == params
    monkeypatch.setattr(loop, "optimizer_step", step_standin)
    monkeypatch.setattr(loop, "token_loss_sum", lambda engine, batch: torch.tensor(2.0))
    from scaletrain.distributed import pipeline

    # install() wraps the pipeline's step and loss too: put them back after this test
    monkeypatch.setattr(loop.PipelineStep, "step", loop.PipelineStep.step)
    monkeypatch.setattr(pipeline.TokenLoss, "__call__", pipeline.TokenLoss.__call__)
    inject_nonfinite.install({5: 10.0, 7: math.nan})
    assert loop.optimizer_step(None, None, 4, None, None, None).item() == 20.0  # data step 5 (1-based)
    assert loop.optimizer_step(None, None, 5, None, None, None).item() == 2.0
    assert math.isnan(loop.optimizer_step(None, None, 6, None, None, None).item())
    assert loop.token_loss_sum(None, None).item() == 2.0  # an evaluation outside the step is untouched


def test_the_loop_holds_no_test_hook():
    source = Path(loop.__file__).read_text()
    assert "inject" not in source.replace("inject_nonfinite.py", "").lower()
    assert "SCALETRAIN_TEST" not in source and "os.environ" not in source


@pytest.mark.parametrize("module", ["scaletrain.train.preemption", "scaletrain.train.loop"])
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
    window.add(torch.tensor(1.0), 10, 1, 0.5, None, None)
    window.add(torch.tensor(1.0), 10, 1, 0.5, {**dict.fromkeys(PHASES, 0.0), "forward": 0.3}, None)
    assert (window.steps, window.phase_steps, window.phases["forward"]) == (2, 1, 0.3)
    cpu = PhaseClock(torch.device("cpu"))
    cpu.start(measured=False)
    assert cpu.measured  # on a CPU every step is split: timing costs nothing there


def test_the_logged_steps_are_known_before_they_run():
    settings = LoopSettings(
        max_steps=25,
        logging_steps=10,
        eval_steps=0,
        save_steps=0,
        save_interval_minutes=0,
        preemption_grace_seconds=60,
        gradient_divisor=1,
        show_progress=False,
    )
    assert [step for step in range(1, 26) if _logged(step, settings)] == [10, 20, 25]
    timers = StepTimers(torch.device("cpu"), save_interval_minutes=0)
    timers.measure_phases = False
    timers.start_step()
    assert timers.close_step(time.perf_counter())[1] is not None  # a CPU step is always split
