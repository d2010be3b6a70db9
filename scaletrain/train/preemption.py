"""Preemption: a signal reaching any rank becomes a save on every rank, agreed at a step boundary. SIGUSR1 or SIGTERM
only sets a flag, since a save inside a signal handler would interleave with the step in flight; the ranks all-reduce
the flag at the next step boundary (Trainer.agree), save the same step and exit errors.SAVED_REQUEUE_EXIT_CODE (85).
Each rank records the committed save (record_preemption_saved), so scaletrain.launcher exits 85 even when DeepSpeed's
launch.py, signalled too, reports 1.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from scaletrain.errors import Preempted
from scaletrain.train.callbacks import Callback, Order, StepOutcome

log = logging.getLogger(__name__)
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


class PreemptionSave(Callback):
    """A signal on any rank: every rank saves the step (committed before it returns) and the run ends, Preempted."""

    order = Order.PREEMPTION_SAVE

    def __init__(self, flag: PreemptionFlag, save: Callable[[], object], grace_seconds: float):
        self.flag, self.save, self.grace_seconds = flag, save, grace_seconds

    def requests(self) -> tuple:
        return ("stop",) if self.flag.signal_name is not None else ()

    def post_step(self, outcome: StepOutcome) -> None:
        if "stop" not in outcome.requests:
            return
        self.trainer.phase("preemption save", long=True)
        seconds = self.trainer.hold("checkpoint", self.save)  # a write in flight is committed first
        record_preemption_saved(outcome.step)  # for scaletrain.launcher, which may not see the ranks' exit code 85
        log.info(
            "preemption (%s): checkpoint committed at step %d in %.1fs",
            self.flag.signal_name or "signal on another rank",
            outcome.step,
            seconds,
        )
        if seconds > self.grace_seconds:
            log.warning(
                "the preemption save took %.1fs, more than --preemption_grace_seconds %.0f: ask the "
                "scheduler for an earlier signal",
                seconds,
                self.grace_seconds,
            )
        raise Preempted(outcome.step)
