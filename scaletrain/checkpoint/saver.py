"""A run's saves: synchronous ones, or (--async_save) snapshots that a writer process writes in the background and
that are committed at a later step boundary, at most one in flight; and the loop's callbacks that commit a save in
flight and save every --save_steps steps or --save_interval_minutes minutes."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scaletrain.checkpoint import commit
from scaletrain.checkpoint.async_save import BackgroundWriter
from scaletrain.distributed import broadcast_from_main
from scaletrain.checkpoint.save import (
    checkpoint_parameters,
    planned_checkpoint_bytes,
    save_checkpoint,
    settle_checkpoint,
    snapshot_buffers_refusal,
    start_checkpoint,
)
from scaletrain.model import base_identity
from scaletrain.observability import GoodputLedger
from scaletrain.parts import DistInfo
from scaletrain.train import Callback, Order, StepOutcome, TrainState


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveSettings:
    """What a run's saves need of its plan."""

    output_dir: str
    save_total_limit: int  # committed checkpoints kept (0: all)
    adapter_only: bool  # LoRA: the base is not saved
    n_params: int  # the whole model's (a pipeline stage's module holds its layers alone)
    precision: str
    zero_stage: int
    model_facts: dict | None  # what a checkpoint records of the model


class Saver:
    """Every rank's saves (collectives: every rank calls save() and commit_pending() at the same step). After each
    commit, rank 0 deletes the checkpoints beyond --save_total_limit in a thread of its own: a slow file system's
    deletions never hold the loop (the next save, and the end of the run, wait for them)."""

    def __init__(
        self,
        settings: SaveSettings,
        *,
        engine,
        state: TrainState,
        ledger: GoodputLedger,
        writer: BackgroundWriter | None,
        dist: DistInfo,
    ):
        self.settings, self.engine, self.state, self.ledger = settings, engine, state, ledger
        self.writer, self.dist = writer, dist
        self.model_facts = settings.model_facts  # what a checkpoint records of the model (a hub base's, once known)
        self._in_flight_step_s = 0.0  # the ledger's step seconds when the save in flight was taken
        self._pruning: threading.Thread | None = None
        self.committed: tuple[int, Path] | None = None  # (step, folder) of this run's newest commit

    def save(self, now: bool = False) -> Path | None:
        """A checkpoint of this step: committed before this returns (synchronous saves, or `now`: the end of the run,
        a preemption), or (--async_save) taken now, written in the background and committed at a later step
        boundary (commit_pending). Either way a save in flight is committed first: at most one at a time, and a
        step is saved once (a preemption at the step of the save in flight commits it and writes nothing more)."""
        self.commit_pending(wait=True)
        if self.committed is not None and self.committed[0] == self.state.step:
            log.info("step %d is already committed (%s): not saved again", self.state.step, self.committed[1])
            return self.committed[1]
        self.wait_for_pruning()  # its space is free before the next save checks the disk
        settings, dist = self.settings, self.dist
        n_params, n_tensors = checkpoint_parameters(self.engine.module, settings.adapter_only)
        if not settings.adapter_only:
            n_params = settings.n_params  # the whole model (a pipeline stage's module holds its layers alone)
        planned = planned_checkpoint_bytes(
            n_params,
            precision=settings.precision,
            zero_stage=settings.zero_stage,
            tensor_parallel_size=dist.layout.tp,
            n_tensors=n_tensors,
            world_size=dist.world_size,
        )
        facts, out, rank = self._model_facts(), settings.output_dir, dist.rank
        if self.writer is not None and not now:
            refusal = None
            if not self.writer.buffers.nbytes:  # the first snapshot: training's memory is all taken by now
                refusal = snapshot_buffers_refusal(settings.n_params, settings.precision, settings.zero_stage, dist)
            refusal = refusal or start_checkpoint(
                self.engine,
                output_dir=out,
                state=self.state,
                rank=rank,
                writer=self.writer,
                model_facts=facts,
                planned_bytes=planned,
            )
            if refusal is None:
                self._in_flight_step_s = self.ledger.attempt["step_s"]
                return None
            if dist.local_rank == 0:  # said once: the buffers are never tried again
                log.warning("--async_save: %s; this and later saves are synchronous", refusal)
            self.writer.close()
            self.writer = None
        path = save_checkpoint(self.engine, out, self.state, rank, model_facts=facts, planned_bytes=planned)
        self.ledger.committed(self.state.step)
        self._committed(self.state.step, path)
        return path

    def _model_facts(self) -> dict | None:
        """The model's facts, with the identity of a hub base this run downloaded (known once it is on disk)."""
        facts = self.model_facts
        if facts and facts.get("base") and facts["base"]["weights"] is None:
            self.model_facts = facts = {**facts, "base": base_identity(facts["base"]["source"])}
        return facts

    def commit_pending(self, wait: bool = False) -> None:
        """--async_save, at a step boundary (every rank): commit the save in flight once every rank's write is done
        (`wait`: this rank's first); a failed write ends the run here."""
        writer = self.writer
        if writer is None or writer.in_flight is None or not writer.in_flight.step:
            return  # nothing in flight
        step = writer.in_flight.step
        committed = settle_checkpoint(writer, self.dist.rank, wait)
        if committed:
            self.ledger.committed(step, self._in_flight_step_s)
            self._committed(step, committed)

    def _committed(self, step: int, path: Path) -> None:
        self.committed = (step, path)
        self._prune(path)

    @property
    def writing(self) -> bool:
        """A background save is in flight."""
        return bool(self.writer and self.writer.in_flight)

    def _prune(self, committed: Path) -> None:
        """Rank 0: the checkpoints beyond --save_total_limit, and the universal copies, deleted in the background."""
        if self.dist.rank != 0:
            return
        self.wait_for_pruning()
        limit = self.settings.save_total_limit
        self._pruning = threading.Thread(
            target=_prune, args=(committed, limit), name="scaletrain-checkpoint-pruning", daemon=True
        )
        self._pruning.start()

    def settle(self) -> None:
        """The save in flight committed (every rank) and rank 0's deletions done: the checkpoints folder holds what
        it will hold when rank 0 looks (the end of training, a rollback)."""
        self.commit_pending(wait=True)
        self.wait_for_pruning()

    def wait_for_pruning(self) -> None:
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None

    def close(self) -> None:
        """A write still in flight here (a crash) is never committed; deletions under way are finished."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.wait_for_pruning()


def _prune(committed: Path, limit: int) -> None:
    """Looked up in commit at each call (a test helper slows it)."""
    try:
        commit.prune_checkpoints(committed.parent, limit, keep=committed)
        commit.remove_universal_copies(committed.parent)
    except OSError as err:  # an old checkpoint left behind costs space, not the run
        log.warning("could not delete old checkpoints in %s: %s", committed.parent, err)


class CommitInFlight(Callback):
    """After each step: commit a background save once every rank's write is done (before the step's record, so
    that a failed write is said before more is written), under the hang watch's allowance of a save."""

    order = Order.COMMIT_IN_FLIGHT

    def __init__(self, saver: Saver):
        self.saver = saver

    def post_step(self, outcome: StepOutcome) -> None:
        if self.saver.writing:
            self.trainer.phase("commit of a background save", long=True)
            self.saver.commit_pending()

    def end_of_training(self, step: int) -> None:
        self.saver.settle()  # --async_save: the save in flight is committed before anything else


class PeriodicSave(Callback):
    """A save every --save_steps steps, and once --save_interval_minutes have passed on any rank (the ranks' clocks
    differ: the step boundary agrees on it); not at the last step, which the end of training saves (--save_at_end)
    unless its checkpoint is already committed."""

    order = Order.PERIODIC_SAVE

    def __init__(self, saver: Saver, save_steps: int, interval_minutes: float, at_end: bool = True):
        self.saver, self.save_steps, self.at_end = saver, save_steps, at_end
        self.interval_s = 60 * interval_minutes
        self.last_save = time.monotonic()

    def end_of_training(self, step: int) -> None:
        # Decided by rank 0: ranks that disagreed about entering a collective save would hang in it.
        saver = self.saver
        newest = broadcast_from_main(commit.newest_committed(saver.settings.output_dir) if saver.dist.is_main else None)
        if self.at_end and (newest is None or commit.committed_step(newest) != step):
            self.saver.save(now=True)

    def requests(self) -> tuple:
        due = self.interval_s and time.monotonic() - self.last_save >= self.interval_s
        return ("save",) if due else ()

    def post_step(self, outcome: StepOutcome) -> None:
        if outcome.last:
            return
        if "save" in outcome.requests or (self.save_steps and outcome.step % self.save_steps == 0):
            self.trainer.phase("save", long=True)
            self.trainer.hold("checkpoint", self.saver.save)
            self.last_save = time.monotonic()
