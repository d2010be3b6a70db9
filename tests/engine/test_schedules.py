"""Each LR schedule against its formula, step by step."""

import math
import re

import pytest

from scaletrain.engine.schedules import (
    LRSchedule,
    describe_schedule_change,
    restart_schedule,
    schedule_for,
    warmup_steps_for,
)

T, W, R = 50, 5, 0.1


def test_warmup_is_linear_and_never_zero():
    s = LRSchedule("cosine", T, W, R)
    assert [s.multiplier(i) for i in range(W)] == pytest.approx([(i + 1) / W for i in range(W)])


def test_cosine_decays_from_peak_to_min():
    s = LRSchedule("cosine", T, W, R)
    for step in range(W, T):
        p = (step - W) / (T - W - 1)
        assert s.multiplier(step) == pytest.approx(R + (1 - R) * 0.5 * (1 + math.cos(math.pi * p)))
    assert s.multiplier(W) == pytest.approx(1.0) and s.multiplier(T - 1) == pytest.approx(R)


def test_linear_decays_from_peak_to_min():
    s = LRSchedule("linear", T, W, R)
    for step in range(W, T):
        assert s.multiplier(step) == pytest.approx(1 - (1 - R) * (step - W) / (T - W - 1))


def test_constant_with_warmup():
    s = LRSchedule("constant_with_warmup", T, W, R)
    assert [s.multiplier(i) for i in range(W, T)] == [1.0] * (T - W)


def test_constant_is_flat_from_the_first_update_whatever_the_warmup_ratio():
    """Hugging Face's `constant`: no warmup, so --warmup_ratio (ours defaults to 0.05) does not apply to it."""
    s = schedule_for("constant", total_steps=T, warmup_steps=0, warmup_ratio=0.5, min_lr_ratio=R, decay_ratio=0.2)
    assert s.warmup_steps == 0 and [s.multiplier(i) for i in range(T)] == [1.0] * T
    assert (
        schedule_for(
            "constant_with_warmup", total_steps=T, warmup_steps=0, warmup_ratio=0.5, min_lr_ratio=R, decay_ratio=0.2
        ).warmup_steps
        == T // 2
    )


def test_warmup_stable_decay():
    s = LRSchedule("wsd", T, W, R, decay_ratio=0.2)
    decay = round(0.2 * T)
    start = T - decay
    assert all(s.multiplier(i) == 1.0 for i in range(W, start))
    for step in range(start, T):
        assert s.multiplier(step) == pytest.approx(1 - (1 - R) * (step - start) / (decay - 1))
    assert s.multiplier(T - 1) == pytest.approx(R)


def test_warmup_steps_flag_wins_over_ratio_and_never_covers_the_run():
    assert warmup_steps_for(100, 7, 0.5) == 7
    assert warmup_steps_for(100, 0, 0.05) == 5
    assert warmup_steps_for(3, 10, 0.0) == 2


def test_schedule_drives_the_real_optimizer():
    """The multiplier is what the optimizer sees through LambdaLR, update by update."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    s = LRSchedule("wsd", 20, 3, 0.2, decay_ratio=0.25)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=0.5)
    sched = LambdaLR(opt, s.multiplier)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5 * s.multiplier(i) for i in range(20)])


# --- a run resumed with another schedule ------------------------------------------------------------------------


def _run_config(kind="cosine", total=100, warmup=5, min_ratio=0.1, decay=0.2, lr=1e-3) -> dict:
    """The schedule keys of a run_config.json ("total_steps" and "warmup_steps" resolved), among other flags."""
    return {
        "lr_scheduler_type": kind,
        "total_steps": total,
        "warmup_steps": warmup,
        "min_lr_ratio": min_ratio,
        "decay_ratio": decay,
        "learning_rate": lr,
        "warmup_ratio": 0.05,
        "max_steps": total,
        "seed": 42,
    }


def _lrs_in(text: str) -> tuple:
    match = re.search(r"goes from (\S+) to (\S+)$", text)
    assert match, text
    return float(match.group(1)), float(match.group(2))


def test_the_same_schedule_is_no_change():
    assert (
        describe_schedule_change(_run_config(), schedule=LRSchedule("cosine", 100, 5, 0.1, 0.2), peak_lr=1e-3, step=40)
        is None
    )
    # decay_ratio is read by wsd only: another value under cosine leaves the curve as it was
    assert (
        describe_schedule_change(
            _run_config(decay=0.5), schedule=LRSchedule("cosine", 100, 5, 0.1, 0.2), peak_lr=1e-3, step=40
        )
        is None
    )
    # an older run_config.json without the resolved numbers says nothing to compare with
    old = {k: v for k, v in _run_config().items() if k != "total_steps"}
    assert describe_schedule_change(old, schedule=LRSchedule("cosine", 200, 5, 0.1), peak_lr=1e-3, step=40) is None


@pytest.mark.parametrize(
    "new",
    [
        LRSchedule("cosine", 200, 5, 0.1, 0.2),  # another --max_steps
        LRSchedule("cosine", 100, 10, 0.1, 0.2),  # another warmup
        LRSchedule("wsd", 100, 5, 0.1, 0.2),  # another kind
        LRSchedule("cosine", 100, 5, 0.0, 0.2),
    ],
)  # another floor
def test_a_changed_schedule_shows_the_lr_before_and_after_at_the_resume_step(new):
    old, step = LRSchedule("cosine", 100, 5, 0.1, 0.2), 40
    text = describe_schedule_change(_run_config(), schedule=new, peak_lr=1e-3, step=step)
    assert text is not None and "\n" not in text and f"resumed at step {step}" in text
    assert f"{old.kind} over 100 steps, warmup 5" in text
    assert f"{new.kind} over {new.total_steps} steps, warmup {new.warmup_steps}" in text
    before, after = _lrs_in(text)
    assert before == pytest.approx(1e-3 * old.multiplier(step), rel=1e-2)
    assert after == pytest.approx(1e-3 * new.multiplier(step), rel=1e-2)
    assert before != pytest.approx(after, rel=1e-2)  # the numbers differ at this step for each change above


def test_a_changed_peak_is_a_change_with_the_same_curve():
    s = LRSchedule("cosine", 100, 5, 0.1, 0.2)
    text = describe_schedule_change(_run_config(lr=1e-3), schedule=s, peak_lr=3e-3, step=40)
    assert "peak 1.00e-03" in text and "peak 3.00e-03" in text
    assert _lrs_in(text) == pytest.approx((1e-3 * s.multiplier(40), 3e-3 * s.multiplier(40)), rel=1e-2)


def test_skipped_updates_hold_the_schedule_back():
    """A skipped update leaves the LR schedule where it was: at step 40 after 3 skips the LR is that of update 37."""
    old, new = LRSchedule("cosine", 100, 5, 0.1, 0.2), LRSchedule("cosine", 200, 5, 0.1, 0.2)
    text = describe_schedule_change(_run_config(), schedule=new, peak_lr=1e-3, step=40, skipped_steps=3)
    assert "resumed at step 40" in text and "the LR at step 40 goes from" in text
    assert _lrs_in(text) == pytest.approx((1e-3 * old.multiplier(37), 1e-3 * new.multiplier(37)), rel=1e-2)


def test_restart_schedule_takes_this_runs_flags_after_a_restore():
    """A LambdaLR restored from another run's state (peak 0.5, 10 steps) follows the new schedule and peak from
    the restored position, from the very next update; the same flags give bitwise the same LRs."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    def trained(schedule, peak, steps):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        sched = LambdaLR(opt, schedule.multiplier)
        for _ in range(steps):
            opt.step()
            sched.step()
        return opt, sched

    old, new = LRSchedule("cosine", 10, 2, 0.1), LRSchedule("linear", 30, 3, 0.0)
    saved_opt, saved = trained(old, 0.5, 6)
    for schedule, peak in ((new, 0.2), (old, 0.5)):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        sched = LambdaLR(opt, schedule.multiplier)
        opt.load_state_dict(saved_opt.state_dict())  # what a checkpoint load does
        sched.load_state_dict(saved.state_dict())
        restart_schedule(sched, schedule, peak)
        seen = []
        for _ in range(4):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert seen == [peak * schedule.multiplier(i) for i in range(6, 10)]
        assert sched.get_last_lr() == [peak * schedule.multiplier(10)]
