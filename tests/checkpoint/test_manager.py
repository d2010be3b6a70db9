"""The checkpoint manager's decisions, in-process: when a step saves and why, what a rank asks of the others at the
step boundary, and the state of the parts it carries beside the train state. Its saves, loads, commits and
rollbacks run on real engines in the slow tests (test_checkpoint.py, test_async_save.py, train/test_nonfinite.py)."""

from __future__ import annotations

import time

import pytest

from scaletrain.checkpoint import CheckpointManager, CheckpointSettings, SaveSchedule
from scaletrain.checkpoint.save import CheckpointContents
from scaletrain.observability import GoodputLedger
from scaletrain.parts import DistInfo, ParallelLayout
from scaletrain.train import NonFiniteGuard, NonFinitePolicy, StepOutcome, TrainState


def manager(tmp_path, **schedule) -> CheckpointManager:
    """A one-rank manager whose decisions are tested; `engine` is not reached by them (no save or load runs)."""
    settings = CheckpointSettings(
        output_dir=str(tmp_path),
        save_total_limit=0,
        adapter_only=False,
        n_params=1000,
        precision="fp32",
        zero_stage=2,
        model_facts=None,
        schedule=SaveSchedule(**schedule),
        async_save=False,
        resume=None,
    )
    return CheckpointManager(
        settings,
        engine=None,
        state=TrainState(),
        ledger=GoodputLedger(tmp_path, is_main=False),
        dist=DistInfo.launched(rank=0, local_rank=0, world_size=1, launcher="python"),
        reloaded=lambda universal: None,
    )


def outcome(step: int, *, last: bool = False, requests: tuple = ()) -> StepOutcome:
    return StepOutcome(
        step=step,
        data_step=step - 1,
        result=None,  # type: ignore[arg-type]  # the decision reads the step, its place and the agreed requests
        seconds=0.0,
        phases=None,
        held=0.0,
        last=last,
        requests=frozenset(requests),
    )


def test_steps_interval_and_preemption_each_give_their_reason_and_the_last_step_is_the_ends(tmp_path):
    checkpoints = manager(tmp_path, save_steps=4)
    assert [step for step in range(1, 13) if checkpoints.due(outcome(step))] == [4, 8, 12]
    assert checkpoints.due(outcome(8)) == ("steps",)
    assert checkpoints.due(outcome(3, requests=("save",))) == ("interval",)  # agreed: some rank's clock passed
    assert checkpoints.due(outcome(8, requests=("save",))) == ("interval",)  # one save, not two, at one step
    assert checkpoints.due(outcome(12, last=True)) == ()  # the end of training saves the last step
    # A preemption at a step whose periodic save is due: that save first (it may be written in the background),
    # then the preemption's, which commits it rather than writing the step again.
    assert checkpoints.due(outcome(8, requests=("stop",))) == ("steps", "preemption")
    assert checkpoints.due(outcome(5, requests=("stop",))) == ("preemption",)
    assert checkpoints.due(outcome(12, last=True, requests=("stop",))) == ("preemption",)
    assert manager(tmp_path).due(outcome(4)) == ()  # --save_steps 0: never by steps


def test_a_rank_asks_for_a_save_once_its_interval_passed_and_for_a_stop_once_signalled(tmp_path):
    checkpoints = manager(tmp_path, interval_minutes=1.0)
    assert checkpoints.requests(preempted=False) == ()
    assert checkpoints.requests(preempted=True) == ("stop",)
    checkpoints._last_save = time.monotonic() - 61  # a minute and a second since the last save (or the start)
    assert checkpoints.requests(preempted=False) == ("save",)
    assert checkpoints.requests(preempted=True) == ("stop", "save")
    checkpoints.training_starts()  # the loop's first step: the interval counts from here, not from the build
    assert checkpoints.requests(preempted=False) == ()
    assert manager(tmp_path).requests(preempted=False) == ()  # --save_interval_minutes 0: never by the clock


def test_the_end_saves_unless_the_last_step_is_committed_or_told_not_to(tmp_path):
    checkpoints = manager(tmp_path)
    assert checkpoints.due_at_end(10)  # nothing committed yet
    committed = tmp_path / "checkpoints" / "step10"
    committed.mkdir(parents=True)
    (committed / "commit.json").write_text('{"step": 10, "files": {}}')
    assert not checkpoints.due_at_end(10)  # resumed at its last step, already saved
    assert checkpoints.due_at_end(12)
    assert not manager(tmp_path, at_end=False).due_at_end(12)  # --no-save_at_end


def test_a_save_reason_outside_the_known_ones_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="hourly"):
        manager(tmp_path).save(reason="hourly")


def spike_guard() -> NonFiniteGuard:
    return NonFiniteGuard(NonFinitePolicy("skip", 0, 3.0, False), TrainState(), ".", is_main=False)


def test_carried_parts_are_saved_beside_the_train_state_under_the_keys_checkpoints_always_used():
    guard = spike_guard()
    for step in range(1, 4):
        guard.after_step(step, global_loss=2.0 * step, forced=None, applied=True, sample_ids=list)
    state = TrainState(step=3, samples_seen=24)
    state.record_layout(ParallelLayout(dp=2), zero_stage=2, offload="optimizer=none,param=none")
    saved = CheckpointContents(state, guard.state_dict()).train_state()
    assert saved["step"] == 3 and saved["world_size"] == 2
    assert (saved["loss_mean"], saved["loss_mean_steps"]) == (pytest.approx(4.0), 3)
    assert "loss_mean" not in state.state_dict()  # the train state holds the loop's position and layout only

    # A checkpoint's train state (this one, or one written when the train state held the mean) restores both.
    for checkpoint in (saved, {**state.state_dict(), "loss_mean": 4.0, "loss_mean_steps": 3, "wandb_run_id": "x"}):
        fresh_state, fresh_guard = TrainState(), spike_guard()
        fresh_state.load_state_dict(checkpoint)
        fresh_guard.load_state_dict(checkpoint)
        assert (fresh_state.step, fresh_state.layout) == (3, ParallelLayout(dp=2))
        assert (fresh_guard.loss_mean, fresh_guard.loss_mean_steps) == (pytest.approx(4.0), 3)
    # One from before the guard kept a mean: it starts afresh, as before.
    old = spike_guard()
    old.load_state_dict(state.state_dict())
    assert (old.loss_mean, old.loss_mean_steps) == (None, 0)


@pytest.mark.slow  # one real 1-rank run of 4 steps with four saves
def test_a_save_interval_saves_at_each_step_boundary_it_has_passed(tmp_path, cache_dir):
    """--save_interval_minutes through train.py: with an interval shorter than a step, every step boundary asks for a
    save (agreed with the loss), the last step is the end's to save, and each is committed once."""
    from scaletrain.checkpoint.commit import committed_step
    from tests.harness import FAST_FLAGS, REPO, check_ok, launch

    run_dir = tmp_path / "run"
    flags = ["--config", "ds_configs/zero2.json", "--output_dir", str(run_dir), "--max_steps", "4"]
    proc = launch(
        REPO / "train.py",
        [*flags, "--save_interval_minutes", "0.0001", "--no-export_hf_at_end", *FAST_FLAGS],
        "python",
        cache_dir,
    )
    check_ok(proc)
    steps = [committed_step(p) for p in (run_dir / "checkpoints").iterdir()]
    assert sorted(step for step in steps if step is not None) == [1, 2, 3, 4]
    assert "already committed" not in proc.stdout + proc.stderr  # no step was asked to save twice
