"""Each LR schedule against its formula, step by step."""

import math

import pytest

from scaletrain.schedules import LRSchedule, warmup_steps_for

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
