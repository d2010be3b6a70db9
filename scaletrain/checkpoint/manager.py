"""A checkpoint's whole life, owned by one CheckpointManager: the load of the resume planned by the pre-flight (with the
universal repair), the one decision of when to save (every --save_steps steps, after --save_interval_minutes, at the
last step, at a preemption), the save itself (synchronous, or with --async_save a snapshot that a writer process
writes in the background and a later step boundary commits, at most one in flight), pruning beyond
--save_total_limit, the rollback to the newest committed checkpoint, and the close. `Checkpointing` is the loop's one
checkpoint callback. Resume planning (resume_point.plan_resume, in the pre-flight) and verification
(resume_point.verify_resume: checksums, fallback, universal conversion, before the model is built) happen before the
manager exists; they decide what `load_resume` loads.

The parts that carry state of their own across a save (the non-finite guard's running mean, the wandb run id) give
the manager their state_dict() to save beside the train state and get it back after each load (`carry`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from scaletrain.checkpoint import commit
from scaletrain.checkpoint.async_save import BackgroundWriter
from scaletrain.checkpoint.resume import load_checkpoint
from scaletrain.checkpoint.rollback import roll_back
from scaletrain.distributed import broadcast_from_main
from scaletrain.checkpoint.save import (
    background_writer,
    CheckpointContents,
    checkpoint_parameters,
    planned_checkpoint_bytes,
    save_checkpoint,
    settle_checkpoint,
    snapshot_buffers_refusal,
    start_checkpoint,
)
from scaletrain.errors import Preempted
from scaletrain.model import base_identity
from scaletrain.observability import GoodputLedger
from scaletrain.parts import DistInfo, ResumePoint
from scaletrain.train import Callback, Order, PreemptionFlag, record_preemption_saved, StepOutcome, TrainState


log = logging.getLogger(__name__)

# Why a checkpoint is saved: the reasons `save` takes. The last two are committed before save() returns.
SAVE_REASONS = ("steps", "interval", "end", "preemption")


@dataclass(frozen=True)
class SaveSchedule:
    """When a run saves: every `save_steps` steps (0: never), once `interval_minutes` have passed on any rank (0:
    never), at the last step (`at_end`, unless that step is already committed), and at a preemption."""

    save_steps: int = 0
    interval_minutes: float = 0.0
    at_end: bool = True
    preemption_grace_seconds: float = 0.0  # a preemption save that takes longer is warned about


@dataclass(frozen=True)
class CheckpointSettings:
    """What a run's checkpoints need of its plan."""

    output_dir: str
    save_total_limit: int  # committed checkpoints kept (0: all)
    adapter_only: bool  # LoRA: the base is not saved
    n_params: int  # the whole model's (a pipeline stage's module holds its layers alone)
    precision: str
    zero_stage: int
    model_facts: dict | None  # what a checkpoint records of the model
    schedule: SaveSchedule
    async_save: bool  # --async_save: saves are written by a background writer process
    resume: ResumePoint | None  # the checkpoint the pre-flight planned to resume (verified by the ranks)


class Carried(Protocol):
    """A part whose state a checkpoint keeps beside the train state (its keys must not collide with another's)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointManager:
    """Every rank's checkpoints (collectives: every rank calls load_resume(), save(), commit_pending(), rollback() at
    the same step). After each commit, rank 0 deletes the checkpoints beyond --save_total_limit in a thread of its
    own: a slow file system's deletions never hold the loop (the next save, and the end of the run, wait for them).
    `reloaded(universal)`: what the run redoes after a load (its own LR schedule, weight decay and layout)."""

    def __init__(
        self,
        settings: CheckpointSettings,
        *,
        engine,
        state: TrainState,
        ledger: GoodputLedger,
        dist: DistInfo,
        reloaded: Callable[[bool], None],
    ):
        self.settings, self.engine, self.state, self.ledger, self.dist = settings, engine, state, ledger, dist
        self.schedule, self.resume, self.reloaded = settings.schedule, settings.resume, reloaded
        self.writer: BackgroundWriter | None = None
        if settings.async_save:  # its process starts now, before training takes the memory
            self.writer = background_writer(settings.n_params, settings.precision, settings.zero_stage, dist)
        self.model_facts = settings.model_facts  # what a checkpoint records of the model (a hub base's, once known)
        self._carried: list[Carried] = []
        self._restored: dict = {}  # the train state of the last load, with the carried parts' keys
        self._in_flight_step_s = 0.0  # the ledger's step seconds when the save in flight was taken
        self._pruning: threading.Thread | None = None
        self._last_save = time.monotonic()  # for --save_interval_minutes (from the first step: training_starts)
        self.committed: tuple[int, Path] | None = None  # (step, folder) of this run's newest commit

    # --- loads: the planned resume, and a rollback's -----------------------------------------------------------------

    def load_resume(self) -> None:
        """The checkpoint the pre-flight planned (and the ranks verified) to resume: weights, optimizer, schedule, RNG,
        the data position; through its universal form when it came from another layout."""
        if self.resume is not None:
            self._load(self.resume.checkpoint, universal=self.resume.reshard)

    @property
    def restored(self) -> dict:
        """The train state the last load restored, with the carried parts' keys (empty: a fresh run)."""
        return dict(self._restored)

    def carry(self, part: Carried) -> None:
        """`part`'s state is saved from now on and restored by every load (at once, if one already happened)."""
        self._carried.append(part)
        if self._restored:
            part.load_state_dict(self._restored)

    def _load(self, checkpoint: Path, universal: bool) -> None:
        self._restored = load_checkpoint(self.engine, checkpoint, self.state, self.dist.rank, universal=universal)
        self.reloaded(universal)
        for part in self._carried:
            part.load_state_dict(self._restored)

    def rollback(self) -> dict:
        """--max_consecutive_skips reached: back to the newest committed checkpoint, the data past the streak; the
        jump's entry for the non-finite ledger."""
        self.settle()  # a save in flight is committed first: it may be the one to go back to
        jump = roll_back(
            state=self.state, output_dir=self.settings.output_dir, dist=self.dist, resume=self.resume, load=self._load
        )
        self.committed = None  # (a fallback past a damaged newest one retrains its step on other data)
        return jump

    # --- when to save: one decision ----------------------------------------------------------------------------------

    def training_starts(self) -> None:
        """The loop starts: --save_interval_minutes count from here, not from the build (a long precompute of the
        reference log-probs is no training to lose)."""
        self._last_save = time.monotonic()

    def requests(self, *, preempted: bool) -> tuple:
        """What this rank asks of every rank at the step boundary: "stop" (a preemption signal reached it), "save"
        (--save_interval_minutes passed on its clock; the ranks' clocks differ, so the boundary agrees on it)."""
        interval_s = 60 * self.schedule.interval_minutes
        due = interval_s and time.monotonic() - self._last_save >= interval_s
        return ("stop",) * preempted + ("save",) * bool(due)

    def due(self, outcome: StepOutcome) -> tuple:
        """The saves the step `outcome` calls for, in order (SAVE_REASONS): a periodic one ("steps", "interval"),
        then "preemption". Not at the last step, which the end of training saves, unless preempted there."""
        schedule, reasons = self.schedule, []
        if not outcome.last:
            if "save" in outcome.requests:
                reasons.append("interval")
            elif schedule.save_steps and outcome.step % schedule.save_steps == 0:
                reasons.append("steps")
        if "stop" in outcome.requests:
            reasons.append("preemption")
        return tuple(reasons)

    def due_at_end(self, step: int) -> bool:
        """The end of training saves `step` unless --no-save_at_end or its checkpoint is already committed (decided
        by rank 0: ranks that disagreed about entering a collective save would hang in it)."""
        if not self.schedule.at_end:
            return False
        out = self.settings.output_dir
        newest = broadcast_from_main(commit.newest_committed(out) if self.dist.is_main else None)
        return newest is None or commit.committed_step(newest) != step

    # --- saves ---------------------------------------------------------------------------------------------------

    def save(self, *, reason: str) -> Path | None:
        """A checkpoint of this step, saved for `reason` (SAVE_REASONS): committed before this returns (synchronous
        saves; "end" and "preemption" always), or (--async_save) taken now, written in the background and committed
        at a later step boundary (commit_pending). Either way a save in flight is committed first: at most one at a
        time, and a step is saved once (a preemption at the step of the save in flight commits it and writes nothing
        more)."""
        assert reason in SAVE_REASONS, reason
        try:
            return self._save(now=reason in ("end", "preemption"))
        finally:
            self._last_save = time.monotonic()  # --save_interval_minutes count from the end of the last save

    def _save(self, now: bool) -> Path | None:
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
        carried = {key: value for part in self._carried for key, value in part.state_dict().items()}
        contents = CheckpointContents(self.state, carried, self._model_facts())
        out, rank = settings.output_dir, dist.rank
        if self.writer is not None and not now:
            refusal = None
            if not self.writer.buffers.nbytes:  # the first snapshot: training's memory is all taken by now
                refusal = snapshot_buffers_refusal(settings.n_params, settings.precision, settings.zero_stage, dist)
            refusal = refusal or start_checkpoint(
                self.engine, output_dir=out, contents=contents, rank=rank, writer=self.writer, planned_bytes=planned
            )
            if refusal is None:
                self._in_flight_step_s = self.ledger.attempt["step_s"]
                return None
            if dist.local_rank == 0:  # said once: the buffers are never tried again
                log.warning("--async_save: %s; this and later saves are synchronous", refusal)
            self.writer.close()
            self.writer = None
        path = save_checkpoint(self.engine, output_dir=out, contents=contents, rank=rank, planned_bytes=planned)
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


class Checkpointing(Callback):
    """The loop's checkpoint callback. After each step, once the step's record and evaluation are done: the commit of
    a background save whose writes are all done (under the hang watch's allowance of a save), then the saves the
    step calls for (CheckpointManager.due); a preemption's save is committed before the run ends, Preempted. At the
    end of training: the save in flight committed, then the final checkpoint (before the Hugging Face export)."""

    order = Order.CHECKPOINTS

    def __init__(self, manager: CheckpointManager, preemption: PreemptionFlag):
        self.manager, self.preemption = manager, preemption

    def pre_train(self) -> None:
        self.manager.training_starts()

    def requests(self) -> tuple:
        return self.manager.requests(preempted=self.preemption.signal_name is not None)

    def post_step(self, outcome: StepOutcome) -> None:
        manager = self.manager
        if manager.writing:
            self.trainer.phase("commit of a background save", long=True)
            manager.commit_pending()
        for reason in manager.due(outcome):
            if reason == "preemption":
                self._save_and_end(outcome.step)  # raises Preempted
            else:
                self.trainer.phase("save", long=True)
                self.trainer.hold("checkpoint", partial(manager.save, reason=reason))

    def _save_and_end(self, step: int) -> None:
        """A signal on any rank: every rank saves the step (committed before it returns) and the run ends."""
        self.trainer.phase("preemption save", long=True)
        seconds = self.trainer.hold("checkpoint", partial(self.manager.save, reason="preemption"))
        record_preemption_saved(step)  # for scaletrain.launcher, which may not see the ranks' exit code 85
        log.info(
            "preemption (%s): checkpoint committed at step %d in %.1fs",
            self.preemption.signal_name or "signal on another rank",
            step,
            seconds,
        )
        grace = self.manager.schedule.preemption_grace_seconds
        if seconds > grace:
            log.warning(
                "the preemption save took %.1fs, more than --preemption_grace_seconds %.0f: ask the "
                "scheduler for an earlier signal",
                seconds,
                grace,
            )
        raise Preempted(step)

    def end_of_training(self, step: int) -> None:
        self.manager.settle()  # --async_save: the save in flight is committed first
        if self.manager.due_at_end(step):
            self.manager.save(reason="end")
