"""Preemption: a signal reaching any rank becomes a save on every rank, agreed at a step boundary.

SIGUSR1 (Slurm's --signal) or SIGTERM (most schedulers, and the deepspeed launcher relaying one) only sets a flag
in the handler: a save started inside a signal handler would interleave with the step in flight. At the next step
boundary the ranks all-reduce the flag (loop.agree_step), so they all save the same step even when one rank got
the signal.
The run then exits with errors.SAVED_REQUEUE_EXIT_CODE (85), which a job script reads as "saved, please requeue".
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger(__name__)
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


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
