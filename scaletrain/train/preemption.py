"""Preemption: a signal reaching any rank becomes a save on every rank, agreed at a step boundary. SIGUSR1 or SIGTERM
only sets a flag, since a save inside a signal handler would interleave with the step in flight; the ranks all-reduce
the flag at the next step boundary (Trainer.agree), save the same step (the checkpoint callback,
checkpoint/manager.py) and exit errors.SAVED_REQUEUE_EXIT_CODE (85).
Each rank records the committed save (record_preemption_saved), so scaletrain.launcher exits 85 even when DeepSpeed's
launch.py, signalled too, reports 1.
"""

from __future__ import annotations

import os
import signal

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
RANK_PREEMPTION_SIGNAL = signal.SIGUSR1  # what scaletrain.launcher sends the ranks (DeepSpeed's launcher ignores it)
PREEMPTION_RECORD_ENV = "SCALETRAIN_PREEMPTION_RECORD"  # set by scaletrain.launcher: the file the ranks append to


def record_preemption_saved(step: int) -> None:
    """After the preemption checkpoint of `step` is committed (every rank is past the commit's last barrier): one
    line in the launcher's record, if a scaletrain.launcher started this rank."""
    path = os.environ.get(PREEMPTION_RECORD_ENV)
    if path:
        with open(path, "a") as record:
            record.write(f"checkpoint of step {step} committed (pid {os.getpid()})\n")


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
