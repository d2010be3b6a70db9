"""What the training loop's step is given: step counts, the loss normaliser's divisor and share, the batch ramp-up's
LR scaling and the objective; and how a run's resolved configuration becomes those settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletrain.config import RunConfig
from scaletrain.parts import DistInfo

if TYPE_CHECKING:
    from scaletrain.model import RouterLoss
    from scaletrain.train.preference import PreferenceObjective

RAMPUP_LR_EXPONENTS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


@dataclass(frozen=True)
class LoopSettings:
    max_steps: int
    logging_steps: int
    gradient_divisor: int  # the ranks DeepSpeed averages gradients over (the data-parallel ones; all under SP)
    rampup_lr_exponent: float = 0.0  # during a batch ramp-up the LR is scaled by (batch / full batch) ** this
    # This rank's share of the reported loss: the ranks of a tensor-parallel group compute the same loss, so only the
    # first of each group counts (0 x NaN is NaN: a non-finite loss is still seen).
    loss_share: float = 1.0
    router_loss: RouterLoss | None = None  # an MoE model's load-balancing loss
    # A preference run's micro-batch objective: (summed per-pair loss, {metric: sum}); None: the token loss.
    objective: PreferenceObjective | None = None


def loop_settings(
    cfg: RunConfig,
    *,
    dist: DistInfo,
    router_loss: RouterLoss | None,
    start_step: int,
    total_steps: int,
    objective: PreferenceObjective | None = None,
) -> LoopSettings:
    """The loop's settings for a run. A dry run takes one full step, logged."""
    layout = dist.layout
    dry = cfg.run.dry_run
    return LoopSettings(
        max_steps=min(start_step + 1, total_steps) if dry else total_steps,
        logging_steps=1 if dry else cfg.logging.logging_steps,
        gradient_divisor=layout.dp * layout.sp,
        loss_share=1.0 if dist.coords.tp == 0 else 0.0,
        rampup_lr_exponent=RAMPUP_LR_EXPONENTS[cfg.optim.rampup_lr_scaling],
        router_loss=router_loss,
        objective=objective,
    )
