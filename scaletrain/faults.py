"""Preemption: a signal reaching any rank becomes a save on every rank, agreed at a step boundary.

SIGUSR1 (Slurm's --signal) or SIGTERM (most schedulers, and the deepspeed launcher relaying one) only sets a flag
in the handler: a save started inside a signal handler would interleave with the step in flight. At the next step
boundary the ranks all-reduce the flag (MAX), so they all save the same step even when one rank got the signal.
The run then exits with SAVED_REQUEUE_EXIT_CODE, which a job script reads as "saved, please requeue".
"""

from __future__ import annotations

import logging
import signal

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



def agree_any(device, *flags: bool) -> list:
    """Each flag becomes True on every rank when it is True on any rank: one small all-reduce (MAX).

    A collective: every rank calls it at the same step boundary. Decisions that depend on a rank's own view
    (a signal it received, its clock) must pass through here, or ranks would save at different steps and hang.
    """
    import torch
    import deepspeed.comm as ds_comm

    tensor = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    ds_comm.all_reduce(tensor, op=ds_comm.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]
