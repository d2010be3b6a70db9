"""Learning-rate schedules as multipliers of the peak LR, indexed by optimizer update (0-based).

Warmup: update s < W uses (s + 1) / W, so the first update already moves the weights (no wasted zero-LR step).
After warmup, a decay phase of n updates starting at update a has progress p = (s - a) / max(1, n - 1), which
is 0 on its first update (peak LR) and 1 on the last update of the run (min_lr_ratio x peak):
  cosine:               r + (1 - r) * 0.5 * (1 + cos(pi * p))       decay over all updates after warmup
  linear:               1 - (1 - r) * p                              decay over all updates after warmup
  constant_with_warmup: 1
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
        if self.kind == "constant_with_warmup":
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


def warmup_steps_for(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    """--warmup_steps wins when set; otherwise the ratio of the total, rounded up. Never the whole run."""
    steps = warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total_steps)
    return min(steps, max(total_steps - 1, 0))
