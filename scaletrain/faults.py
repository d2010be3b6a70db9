"""Preemption: a signal reaching any rank becomes a save on every rank, agreed at a step boundary.

SIGUSR1 (Slurm's --signal) or SIGTERM (most schedulers, and the deepspeed launcher relaying one) only sets a flag
in the handler: a save started inside a signal handler would interleave with the step in flight. At the next step
boundary the ranks all-reduce the flag (loop.agree_step), so they all save the same step even when one rank got
the signal.
The run then exits with SAVED_REQUEUE_EXIT_CODE, which a job script reads as "saved, please requeue".
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Optional

log = logging.getLogger(__name__)
SAVED_REQUEUE_EXIT_CODE = 85
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(Exception):
    """Raised after the preemption checkpoint is committed; train.py turns it into SAVED_REQUEUE_EXIT_CODE."""


class PreemptionFlag:
    def __init__(self):
        self.signal_name = None
        self._previous = {}

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name



TEST_INJECT_ENV = "SCALETRAIN_TEST_INJECT_NONFINITE"


def injected_loss_factor(data_step: int, rank: int) -> Optional[float]:
    """TEST-ONLY fault injection, inert unless SCALETRAIN_TEST_INJECT_NONFINITE is set: "RANK:STEP,STEPxF,..."
    multiplies that rank's loss at those data steps (1-based) by NaN, or by F when given (a loss spike). The
    backward then sees the same bad loss, as it would with a real bad batch."""
    spec = os.environ.get(TEST_INJECT_ENV)
    if not spec:
        return None
    target, _, steps = spec.partition(":")
    if int(target) != rank:
        return None
    for item in steps.split(","):
        step, _, factor = item.partition("x")
        if int(step) == data_step:
            return float(factor) if factor else float("nan")
    return None
