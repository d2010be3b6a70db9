"""Learning-rate schedules as multipliers of the peak LR, indexed by optimizer update (0-based).

Warmup: update s < W uses (s + 1) / W, so the first update already moves the weights (no wasted zero-LR step).
After warmup, a decay phase of n updates starting at update a has progress p = (s - a) / max(1, n - 1), which
is 0 on its first update (peak LR) and 1 on the last update of the run (min_lr_ratio x peak):
  cosine:               r + (1 - r) * 0.5 * (1 + cos(pi * p))       decay over all updates after warmup
  linear:               1 - (1 - r) * p                              decay over all updates after warmup
  constant_with_warmup: 1
  constant:             1 from the first update (no warmup: Hugging Face's meaning)
  wsd (warmup-stable-decay): 1 until the last D = round(decay_ratio * T) updates, then linear to r over them
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    kind: str
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float
    decay_ratio: float = 0.2

    @property
    def decay_steps(self) -> int:
        if self.kind == "wsd":
            return min(self.total_steps - self.warmup_steps, max(1, round(self.decay_ratio * self.total_steps)))
        return self.total_steps - self.warmup_steps

    def multiplier(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind in ("constant", "constant_with_warmup"):
            return 1.0
        start = self.total_steps - self.decay_steps
        if step < start:
            return 1.0  # wsd's stable phase
        p = min(1.0, (step - start) / max(1, self.decay_steps - 1))
        r = self.min_lr_ratio
        if self.kind == "cosine":
            return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
        if self.kind in ("linear", "wsd"):
            return 1.0 - (1.0 - r) * p
        raise ValueError(f"unknown schedule {self.kind}")


def schedule_for(
    kind: str, *, total_steps: int, warmup_steps: int, warmup_ratio: float, min_lr_ratio: float, decay_ratio: float
) -> LRSchedule:
    """The run's schedule from its flags; `constant` has no warmup, whatever --warmup_ratio says."""
    warmup = 0 if kind == "constant" else warmup_steps_for(total_steps, warmup_steps, warmup_ratio)
    return LRSchedule(
        kind, total_steps=total_steps, warmup_steps=warmup, min_lr_ratio=min_lr_ratio, decay_ratio=decay_ratio
    )


def warmup_steps_for(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    """--warmup_steps wins when set; otherwise the ratio of the total, rounded up. Never the whole run."""
    steps = warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total_steps)
    return min(steps, max(total_steps - 1, 0))


SCHEDULE_KEYS = ("lr_scheduler_type", "total_steps", "warmup_steps", "min_lr_ratio", "decay_ratio", "learning_rate")


def schedule_of_run(run_config: dict) -> LRSchedule | None:
    """The schedule a run followed, from its run_config.json (whose "total_steps" and "warmup_steps" are the
    resolved numbers); None for a file that lacks one of them."""
    if any(key not in run_config for key in SCHEDULE_KEYS):
        return None
    return LRSchedule(
        run_config["lr_scheduler_type"],
        total_steps=run_config["total_steps"],
        warmup_steps=run_config["warmup_steps"],
        min_lr_ratio=run_config["min_lr_ratio"],
        decay_ratio=run_config["decay_ratio"],
    )


def _describe(schedule: LRSchedule, peak_lr: float, other: LRSchedule, other_peak: float) -> str:
    """The schedule in words; the ratios and the peak only where they differ from `other`."""
    text = f"{schedule.kind} over {schedule.total_steps} steps, warmup {schedule.warmup_steps}"
    if schedule.min_lr_ratio != other.min_lr_ratio:
        text += f", min_lr_ratio {schedule.min_lr_ratio:g}"
    if schedule.decay_ratio != other.decay_ratio and "wsd" in (schedule.kind, other.kind):
        text += f", decay_ratio {schedule.decay_ratio:g}"
    if peak_lr != other_peak:
        text += f", peak {peak_lr:.2e}"
    return text


def describe_schedule_change(
    previous: dict, *, schedule: LRSchedule, peak_lr: float, step: int, skipped_steps: int = 0
) -> str | None:
    """The warning for a run resumed at `step` with another schedule (or peak LR) than the run_config.json
    `previous` of the run it continues (its peak: "peak_lr" where the reader added the resolved one, else
    "learning_rate"): both schedules and the LR each gives at that step. None when the curve is the same (a
    decay_ratio that only wsd reads is no change) or `previous` does not say.

    A skipped update does not advance the schedule, so at `step` it stands at `step - skipped_steps`."""
    position = step - skipped_steps
    old = schedule_of_run(previous)
    if old is None:
        return None
    old_peak = previous.get("peak_lr", previous["learning_rate"])
    if old.kind != "wsd" and schedule.kind != "wsd":
        old = LRSchedule(
            old.kind,
            total_steps=old.total_steps,
            warmup_steps=old.warmup_steps,
            min_lr_ratio=old.min_lr_ratio,
            decay_ratio=schedule.decay_ratio,
        )
    if old == schedule and old_peak == peak_lr:
        return None
    before, after = old_peak * old.multiplier(position), peak_lr * schedule.multiplier(position)
    return (
        f"resumed at step {step} with another LR schedule ({_describe(old, old_peak, schedule, peak_lr)} -> "
        f"{_describe(schedule, peak_lr, old, old_peak)}): the LR at step {step} goes from {before:.2e} to "
        f"{after:.2e}"
    )


def restart_schedule(scheduler, schedule: LRSchedule, peak_lr: float) -> None:
    """After a checkpoint restored a LambdaLR (and its optimizer): this run's peak and schedule from the
    scheduler's position on. The restored state holds the saving run's peak (base_lrs) and the LR the saving
    run's schedule gave for the next update; unchanged flags give the same numbers (the same arithmetic as
    LambdaLR's), changed ones take effect at once instead of being ignored (the peak) or one update late."""
    step = scheduler.last_epoch
    groups = scheduler.optimizer.param_groups
    lr = peak_lr * schedule.multiplier(step)  # LambdaLR's own product: base_lr * lambda(last_epoch)
    scheduler.base_lrs = [peak_lr] * len(groups)
    for group in groups:
        if hasattr(group["lr"], "fill_"):
            group["lr"].fill_(lr)  # a tensor LR is updated in place, as LambdaLR does
        else:
            group["lr"] = lr
        group["initial_lr"] = peak_lr
    scheduler._last_lr = [lr] * len(groups)
