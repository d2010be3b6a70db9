"""Non-finite losses and gradient norms, and loss spikes: skip the update on every rank, keep a ledger, roll back.

The decision is global. Before the optimizer step of each step, the ranks all-reduce their summed losses (in the
same small all-reduce that agrees on preemption), so every rank sees the same global loss and takes the same
decision, even when only one rank's batch went bad. A skipped update goes through DeepSpeed's own overflow path
(the one fp16 loss scaling uses): no weight or optimizer-state change, the gradients are cleared, and the LR
schedule does not advance. DeepSpeed also refuses a step whose gradient norm is non-finite; those steps are
caught after the fact (`engine.was_step_applied()`) and handled the same way, except under fp16, where an
overflow is the loss scaler's normal business.

Every skipped step is written to <output_dir>/nonfinite_ledger.jsonl with the global sample ids (block indices
of the training order) of its batch. After --max_consecutive_skips skips in a row the run rolls back to the last
committed checkpoint and continues with the data after the offending batches; with --on_nonfinite stop it ends
at the first one with a message and NONFINITE_EXIT_CODE.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from scaletrain.state import TrainState

log = logging.getLogger(__name__)

NONFINITE_EXIT_CODE = 3
LEDGER_FILE = "nonfinite_ledger.jsonl"
SPIKE_WARMUP_STEPS = 10  # applied steps before the running mean is trusted for spike detection
MEAN_DECAY = 0.95  # exponential running mean once warmed up


class NonFiniteStop(Exception):
    """--on_nonfinite stop (or a rollback with nothing to roll back to): train.py exits NONFINITE_EXIT_CODE."""


@dataclass(frozen=True)
class NonFinitePolicy:
    action: str  # "skip" or "stop"
    max_consecutive_skips: int  # 0: never roll back
    loss_spike_factor: float  # 0: off
    fp16: bool  # DeepSpeed-side skips are loss-scale overflows, not failures


class SkipSwitch:
    """Makes the next engine.step() at an accumulation boundary skip its update, through DeepSpeed's overflow path.

    ZeRO-1/2 (DeepSpeedZeroOptimizer) and ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) both discard a step when their
    `overflow` flag is set: gradients cleared, loss scale updated, and the engine skips the LR scheduler and counts
    the step in `skipped_steps`. The switch sets that flag where each optimizer computes it. A plain torch optimizer
    (ZeRO stage 0, fp32) has its step replaced by a zero_grad. These hook DeepSpeed internals: tests/test_nonfinite.py
    checks every stage, so a DeepSpeed upgrade that moves them fails there, not in a user's run.
    """

    def __init__(self, optimizer):
        self.skip = False
        if hasattr(optimizer, "_overflow_check_and_loss_scale_update"):  # ZeRO-3
            original = optimizer._overflow_check_and_loss_scale_update

            def check_stage3(update_scale=True):
                if not self.skip:
                    return original(update_scale)
                optimizer.overflow = True
                return optimizer._loss_scale_update_and_overflow_cleanup() if update_scale else True

            optimizer._overflow_check_and_loss_scale_update = check_stage3
        elif hasattr(optimizer, "check_grad_overflow") and hasattr(optimizer, "check_overflow"):  # ZeRO-1/2
            original_check, checked = optimizer.check_overflow, optimizer.check_grad_overflow

            def check_stage12(partition_gradients=True):
                if self.skip:
                    optimizer.overflow = True
                elif checked:
                    original_check(partition_gradients=partition_gradients)

            optimizer.check_overflow = check_stage12
            # Now consulted on every step; a non-finite gradient norm also counts as overflow under bf16.
            optimizer.check_grad_overflow = True
        elif type(optimizer).__module__.startswith("torch.optim"):
            original_step = optimizer.step
            optimizer.overflow = False

            def step(*args, **kwargs):
                optimizer.overflow = self.skip
                if self.skip:
                    optimizer.zero_grad(set_to_none=True)
                    return None
                return original_step(*args, **kwargs)

            optimizer.step = step
        else:
            raise RuntimeError(f"--on_nonfinite skip: cannot skip updates of a {type(optimizer).__name__} optimizer "
                               "(use ZeRO stage 1-3, or --on_nonfinite stop)")


class NonFiniteGuard:
    """Judges each step before its update, counts skips after it, and writes the ledger (rank 0)."""

    def __init__(self, policy: NonFinitePolicy, state: TrainState, output_dir: str, is_main: bool,
                 write_files: bool = True):
        self.policy = policy
        self.state = state
        self.ledger = Path(output_dir) / LEDGER_FILE if is_main and write_files else None

    def judge(self, global_loss: float) -> Optional[str]:
        """Why this step's update must not be applied, or None. Same input on every rank, same answer."""
        if not math.isfinite(global_loss):
            return "nonfinite_loss"
        mean, factor = self.state.loss_mean, self.policy.loss_spike_factor
        if factor and mean is not None and self.state.loss_mean_steps >= SPIKE_WARMUP_STEPS \
                and global_loss > factor * mean:
            return "loss_spike"
        return None

    def after_step(self, step: int, global_loss: float, forced: Optional[str], applied: bool,
                   sample_ids: Callable[[], list]) -> str:
        """"ok", "skipped" or "rollback"; raises NonFiniteStop under --on_nonfinite stop."""
        state = self.state
        reason = forced
        if reason is None and not applied:
            if self.policy.fp16:
                return "ok"  # a loss-scale overflow: the scaler lowers the scale and the next step goes on
            reason = "nonfinite_grad_norm"
        if reason is None:
            state.consecutive_skips = 0
            n = state.loss_mean_steps
            state.loss_mean = global_loss if state.loss_mean is None else (
                state.loss_mean + (global_loss - state.loss_mean) / (n + 1) if n < SPIKE_WARMUP_STEPS
                else MEAN_DECAY * state.loss_mean + (1 - MEAN_DECAY) * global_loss)
            state.loss_mean_steps = n + 1
            return "ok"
        state.consecutive_skips += 1
        samples = sample_ids()
        self.record({"step": step, "event": "skipped", "reason": reason,
                     "loss": global_loss if math.isfinite(global_loss) else str(global_loss),
                     "running_mean_loss": state.loss_mean, "consecutive": state.consecutive_skips,
                     "data_step": step + state.data_offset, "samples": samples})
        if self.policy.action == "stop":
            raise NonFiniteStop(f"step {step}: {reason.replace('_', ' ')} (loss {global_loss:.4g}) on global samples "
                                f"{_short(samples)}; stopped (--on_nonfinite stop). The ledger is {LEDGER_FILE} in "
                                "the run folder; rerun with --on_nonfinite skip to skip such steps")
        log.warning("step %d: %s (loss %.4g); update skipped on every rank (%d in a row), samples %s", step,
                    reason.replace("_", " "), global_loss, state.consecutive_skips, _short(samples))
        limit = self.policy.max_consecutive_skips
        return "rollback" if limit and state.consecutive_skips >= limit else "skipped"

    def record(self, entry: dict) -> None:
        if self.ledger is None:
            return
        with open(self.ledger, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"time": round(time.time(), 3), **entry}) + "\n")


def _short(ids: list, limit: int = 8) -> str:
    return str(ids) if len(ids) <= limit else f"{ids[:limit]}... ({len(ids)} samples)"
