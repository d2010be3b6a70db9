"""The ZeRO optimizers' fp16 overflow path, hooked by --on_nonfinite skip: SkipSwitch makes the next update at an
accumulation boundary be discarded the way DeepSpeed discards an overflowed one (ZeRO-1/2's check_overflow, ZeRO-3's
_overflow_check_and_loss_scale_update), or a plain torch optimizer's step be replaced by a zero_grad."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from scaletrain.engine.ds_internals.guard import CHECKED_DEEPSPEED_VERSIONS, Hook


def _no_check_grad_overflow(init: object) -> str | None:
    import inspect

    # An instance attribute, set from this argument: the class itself cannot show it.
    # Hook.problem takes any found value; this one is DeepSpeedZeroOptimizer.__init__.
    if "check_grad_overflow" in inspect.signature(cast(Callable[..., Any], init)).parameters:
        return None
    return "no longer takes check_grad_overflow (the instance flag SkipSwitch sets)"


_SKIP, _SKIP_INSTEAD = "--on_nonfinite skip", "use --on_nonfinite stop"
_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"


# Proven to act by tests/train/test_nonfinite.py::test_a_nan_on_one_rank_skips_the_update_on_every_rank: [zero3,
# zero3_offload] for ZeRO-3's hooks, [zero1, zero2_offload] and the rollback test (zero2) for ZeRO-1/2's.
STAGE3_CHECK = Hook(_STAGE3, "_overflow_check_and_loss_scale_update", _SKIP, _SKIP_INSTEAD)
STAGE3_CLEANUP = Hook(_STAGE3, "_loss_scale_update_and_overflow_cleanup", _SKIP, _SKIP_INSTEAD)
STAGE12_CHECK = Hook(_STAGE12, "check_overflow", _SKIP, _SKIP_INSTEAD)
STAGE12_INIT = Hook(_STAGE12, "__init__", _SKIP, _SKIP_INSTEAD, problem=_no_check_grad_overflow)
STAGE12_CHECKED = Hook(_STAGE12, "check_grad_overflow", _SKIP, _SKIP_INSTEAD)  # on the instance only
OVERFLOW = Hook(_STAGE12, "overflow", _SKIP, _SKIP_INSTEAD)  # on the instance only (either ZeRO optimizer)


class NonFiniteSkipBroken(RuntimeError):
    """The non-finite skip's hook did not skip an update (see SkipSwitch.confirm_skipped)."""


class SkipSwitch:
    """Makes the next engine.step() at an accumulation boundary skip its update, through DeepSpeed's overflow path.

    ZeRO-1/2 (DeepSpeedZeroOptimizer) and ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) both discard a step when their
    `overflow` flag is set: gradients cleared, loss scale updated, and the engine skips the LR scheduler and counts
    the step in `skipped_steps`. The switch sets that flag where each optimizer computes it. A plain torch optimizer
    (ZeRO stage 0, fp32) has its step replaced by a zero_grad. Any other optimizer is refused.
    """

    def __init__(self, optimizer):
        self.skip = False
        self.fired = 0  # how often a hook acted on `skip` since the last confirm_skipped
        # A plain torch optimizer first: a stage-0 run needs none of the ZeRO internals.
        if type(optimizer).__module__.startswith("torch.optim"):
            self._hook_torch(optimizer)
        elif isinstance(optimizer, STAGE3_CHECK.owner_object()):
            self._hook_stage3(optimizer)
        elif isinstance(optimizer, STAGE12_CHECK.owner_object()):
            self._hook_stage12(optimizer)
        else:
            raise RuntimeError(
                f"--on_nonfinite skip: cannot skip updates of a {type(optimizer).__name__} optimizer "
                "(use ZeRO stage 1-3, or --on_nonfinite stop)"
            )

    def confirm_skipped(self, engine) -> None:
        """After a step the switch was to skip: its hook ran and DeepSpeed did not apply the update. A DeepSpeed that
        no longer calls the hooked method, or that ignores the overflow flag, stops the run here instead of silently
        applying the updates the non-finite policy rejected."""
        fired, self.fired = self.fired, 0
        if fired and not engine.was_step_applied():
            return
        import deepspeed

        raise NonFiniteSkipBroken(
            f"--on_nonfinite skip: a step to be skipped was {'applied' if fired else 'not intercepted'} (the hook "
            f"{'ran' if fired else 'never ran'}): DeepSpeed {deepspeed.__version__} handles updates differently from "
            f"the versions this hook was checked with ({', '.join(CHECKED_DEEPSPEED_VERSIONS)}); use --on_nonfinite "
            "stop or a checked DeepSpeed"
        )

    def _hook_stage3(self, optimizer) -> None:
        # Every hook is resolved before any is installed: a moved one leaves the optimizer untouched.
        original = STAGE3_CHECK.on(optimizer)
        cleanup = STAGE3_CLEANUP.on(optimizer)
        OVERFLOW.on(optimizer)

        def check_stage3(update_scale=True):
            if not self.skip:
                return original(update_scale)
            self.fired += 1
            optimizer.overflow = True
            return cleanup() if update_scale else True

        optimizer._overflow_check_and_loss_scale_update = check_stage3

    def _hook_stage12(self, optimizer) -> None:
        original_check = STAGE12_CHECK.on(optimizer)
        checked = STAGE12_CHECKED.on(optimizer)
        OVERFLOW.on(optimizer)

        def check_stage12(partition_gradients=True):
            if self.skip:
                self.fired += 1
                optimizer.overflow = True
            elif checked:
                original_check(partition_gradients=partition_gradients)

        optimizer.check_overflow = check_stage12
        # Now consulted on every step; a non-finite gradient norm also counts as overflow under bf16.
        optimizer.check_grad_overflow = True

    def _hook_torch(self, optimizer) -> None:
        original_step = optimizer.step
        optimizer.overflow = False

        def step(*args, **kwargs):
            optimizer.overflow = self.skip
            if self.skip:
                self.fired += 1
                optimizer.zero_grad(set_to_none=True)
                return None
            return original_step(*args, **kwargs)

        optimizer.step = step
