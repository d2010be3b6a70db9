"""Non-finite losses and gradient norms, and loss spikes: skip the update on every rank, keep a ledger, roll back. The
ranks decide on the global loss (in the small all-reduce that agrees on preemption), so they decide alike even when one
rank's batch went bad. A skip goes through DeepSpeed's own overflow path (fp16 loss scaling's), so weights, optimizer
state and LR schedule stay as they were; a step DeepSpeed refused for a non-finite gradient norm is caught after the
fact (`engine.was_step_applied()`), except under fp16, where that is the loss scaler's business. Ledger, rollback and
exit codes: docs/checkpoints.md#non-finite-loss-or-gradient-norm-loss-spikes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from collections.abc import Callable

from scaletrain.config import NonFiniteArgs
from scaletrain.errors import NonFiniteStop
from scaletrain.train.callbacks import Callback, Order, RolledBack, StepOutcome
from scaletrain.train.state import TrainState

log = logging.getLogger(__name__)

LEDGER_FILE = "nonfinite_ledger.jsonl"
SPIKE_WARMUP_STEPS = 10  # applied steps before the running mean is trusted for spike detection
MEAN_DECAY = 0.95  # exponential running mean once warmed up


@dataclass(frozen=True)
class NonFinitePolicy:
    action: str  # "skip" or "stop"
    max_consecutive_skips: int  # 0: never roll back
    loss_spike_factor: float  # 0: off
    fp16: bool  # DeepSpeed-side skips are loss-scale overflows, not failures

    @classmethod
    def from_args(cls, args: NonFiniteArgs, fp16: bool) -> NonFinitePolicy:
        return cls(args.on_nonfinite, args.max_consecutive_skips, args.loss_spike_factor, fp16)


class NonFiniteGuard(Callback):
    """Judges each step before its update, counts skips after it, writes the ledger (rank 0) and, after
    --max_consecutive_skips skips in a row, rolls the run back through `rollback` (which returns the jump's entry).
    Its running mean of the applied steps' losses (for --loss_spike_factor) is its own state, which checkpoints carry
    (state_dict, load_state_dict) under the keys they have always used."""

    order = Order.NONFINITE_GUARD

    def __init__(
        self,
        policy: NonFinitePolicy,
        state: TrainState,
        output_dir: str,
        is_main: bool,
        write_files: bool = True,
        rollback: Callable[[], dict] | None = None,
    ):
        self.policy = policy
        self.state = state
        self.ledger = Path(output_dir) / LEDGER_FILE if is_main and write_files else None
        self.rollback = rollback
        self.loss_mean: float | None = None  # running mean of the applied steps' losses
        self.loss_mean_steps = 0  # how many applied steps the running mean has seen

    def state_dict(self) -> dict:
        return {"loss_mean": self.loss_mean, "loss_mean_steps": self.loss_mean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.loss_mean, self.loss_mean_steps = state.get("loss_mean"), state.get("loss_mean_steps", 0)

    def veto_update(self, global_loss: float) -> str | None:
        return self.judge(global_loss)

    def post_step(self, outcome: StepOutcome) -> None:
        result = outcome.result
        samples = partial(self.trainer.batches.sample_ids, outcome.data_step)
        if (
            self.after_step(
                outcome.step,
                global_loss=result.global_loss,
                forced=result.forced,
                applied=result.applied,
                sample_ids=samples,
            )
            == "rollback"
        ):
            self.trainer.phase("rollback", long=True)
            assert self.rollback is not None, "a rollback policy is built with its rollback"
            self.record(self.rollback())  # back to the newest committed checkpoint, the data past this streak
            raise RolledBack

    def judge(self, global_loss: float) -> str | None:
        """Why this step's update must not be applied, or None. Same input on every rank, same answer."""
        if not math.isfinite(global_loss):
            return "nonfinite_loss"
        mean, factor = self.loss_mean, self.policy.loss_spike_factor
        if factor and mean is not None and self.loss_mean_steps >= SPIKE_WARMUP_STEPS and global_loss > factor * mean:
            return "loss_spike"
        return None

    def after_step(
        self, step: int, *, global_loss: float, forced: str | None, applied: bool, sample_ids: Callable[[], list]
    ) -> str:
        """ "ok", "skipped" or "rollback"; raises NonFiniteStop under --on_nonfinite stop."""
        state = self.state
        reason = forced
        if reason is None and not applied:
            if self.policy.fp16:
                return "ok"  # a loss-scale overflow: the scaler lowers the scale and the next step goes on
            reason = "nonfinite_grad_norm"
        if reason is None:
            state.consecutive_skips = 0
            n, mean = self.loss_mean_steps, self.loss_mean
            self.loss_mean = (
                global_loss
                if mean is None
                else (
                    mean + (global_loss - mean) / (n + 1)
                    if n < SPIKE_WARMUP_STEPS
                    else MEAN_DECAY * mean + (1 - MEAN_DECAY) * global_loss
                )
            )
            self.loss_mean_steps = n + 1
            return "ok"
        state.consecutive_skips += 1
        samples = sample_ids()
        self.record(
            {
                "step": step,
                "event": "skipped",
                "reason": reason,
                "loss": global_loss if math.isfinite(global_loss) else str(global_loss),
                "running_mean_loss": self.loss_mean,
                "consecutive": state.consecutive_skips,
                "data_step": step + state.data_offset,
                "samples": samples,
            }
        )
        if self.policy.action == "stop":
            raise NonFiniteStop(
                f"step {step}: {reason.replace('_', ' ')} (loss {global_loss:.4g}) on global samples "
                f"{_short(samples)}; stopped (--on_nonfinite stop). The ledger is {LEDGER_FILE} in "
                "the run folder; rerun with --on_nonfinite skip to skip such steps"
            )
        log.warning(
            f"step {step}: {reason.replace('_', ' ')} (loss {global_loss:.4g}); update skipped on every rank ("
            f"{state.consecutive_skips} in a row), samples {_short(samples)}"
        )
        limit = self.policy.max_consecutive_skips
        return "rollback" if limit and state.consecutive_skips >= limit else "skipped"

    def record(self, entry: dict) -> None:
        if self.ledger is None:
            return
        with open(self.ledger, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"time": round(time.time(), 3), **entry}) + "\n")


def _short(ids: list, limit: int = 8) -> str:
    return str(ids) if len(ids) <= limit else f"{ids[:limit]}... ({len(ids)} samples)"
