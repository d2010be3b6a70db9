"""The ways a run ends on purpose, each with its exit code and who reports it: train.py maps them in one place.

Imports nothing heavy: the config module raises UsageError before torch is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.parts import DistInfo

USAGE_EXIT_CODE = 2  # a user mistake, found before heavy work
FAILED_EXIT_CODE = 1  # the run could not go on (full disk, a failed preparation); nothing committed was lost
NONFINITE_EXIT_CODE = 3  # --on_nonfinite stop: not a requeue, the same data would fail again
SAVED_REQUEUE_EXIT_CODE = 85  # preempted, checkpoint committed: "saved, please requeue"
HANG_EXIT_CODE = 86  # no progress for --hang_timeout: the stuck ranks named, stacks dumped (train/hang.py)


class RunEnded(Exception):
    """Base of the planned ends of a run. `exit_code` is the process's; `reported_by` says which ranks print it:
    "main" (the same message on every rank, printed once), "node" (printed by each node's local rank 0), "every
    rank" (a rank's own trouble), or "nobody"."""

    exit_code = FAILED_EXIT_CODE
    reported_by = "every rank"
    prefix = "error"
    node: str | None = None  # the host the message is prefixed with, where the ranks span several hosts

    def reports_here(self, dist: DistInfo) -> bool:
        """`dist`: this rank's DistInfo. "node" messages are printed by each node's local rank 0."""
        return (
            self.reported_by == "every rank"
            or (self.reported_by == "main" and dist.is_main)
            or (self.reported_by == "node" and dist.local_rank == 0)
        )


class UsageError(RunEnded):
    """A user mistake: one line naming the flag, key or file, and an optional hint line. Exit code 2."""

    exit_code = USAGE_EXIT_CODE
    # Said once per node: the same mistake is found by every rank of a node, and one that exists on one node only (a
    # node-local folder missing) must be seen in that node's output too.
    reported_by = "node"

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"

    def __reduce__(self):  # raised in a worker process and again in its parent: the hint survives the pickle
        return type(self), (self.message, self.hint)


class CheckpointWriteError(RunEnded):
    """A save could not be written (disk full, I/O error); the previous committed checkpoint is intact.

    `every_rank`: all ranks raise it with the same message (agreed after a space check), so rank 0 alone prints it.
    """

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank

    def reports_here(self, dist: DistInfo) -> bool:
        return dist.is_main or not self.every_rank


class PrepareError(RunEnded):
    """Token store preparation failed (a tokenizer worker died, the disk filled); nothing of the store is kept."""


class TokenStoreFailed(RunEnded):
    """Raised on a rank that waited for local rank 0 to prepare the token store, when that preparation failed:
    the preparing rank has printed why."""

    reported_by = "nobody"


class PreparerDied(TokenStoreFailed):
    """Raised on a waiting rank when local rank 0 ended (killed: out of memory, a signal) while preparing the token
    store, without leaving a failure marker: nobody else can say it, so every waiting rank does."""

    reported_by = "every rank"


class UniversalConversionFailed(RunEnded):
    """Global rank 0 could not convert the checkpoint to resume into DeepSpeed's universal format. Rank 0 prints the
    converter's output; a rank that waited for it (`waited`) says so once per node, from its local rank 0."""

    def __init__(self, message: str, waited: bool = False):
        super().__init__(message)
        self.reported_by = "node" if waited else "every rank"


class PeerStopped(RunEnded):
    """This rank's own phase went fine, another rank's did not: every rank stops with that rank's exit code, and
    global rank 0 (unless it has its own error to print) names the rank and host that stopped the run."""

    reported_by = "main"
    prefix = "stopped"

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RanksDisagree(RunEnded):
    """Ranks see different inputs (resume checkpoint, token store, tokenizer, run configuration): training them
    together would diverge silently or hang, so every rank stops; the message is the same on all, printed once."""

    exit_code = USAGE_EXIT_CODE
    reported_by = "main"


class NonFiniteStop(RunEnded):
    """--on_nonfinite stop (or a rollback with nothing to roll back to)."""

    exit_code = NONFINITE_EXIT_CODE
    reported_by = "main"
    prefix = "stopped"


class Preempted(RunEnded):
    """Raised after the preemption checkpoint is committed; train.py exits with SAVED_REQUEUE_EXIT_CODE."""

    exit_code = SAVED_REQUEUE_EXIT_CODE
    reported_by = "nobody"

    def __init__(self, step: int):
        super().__init__(f"preempted at step {step}")
        self.step = step
