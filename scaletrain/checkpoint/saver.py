"""A run's saves: synchronous ones, or (--async_save) snapshots that a writer process writes in the background and
that are committed at a later step boundary, at most one in flight; and the loop's callbacks that commit a save in
flight and save every --save_steps steps or --save_interval_minutes minutes."""

from __future__ import annotations

import time
from pathlib import Path

from scaletrain.checkpoint.async_save import BackgroundWriter
from scaletrain.checkpoint.save import (
    checkpoint_parameters,
    planned_checkpoint_bytes,
    save_checkpoint,
    settle_checkpoint,
    start_checkpoint,
)
from scaletrain.model import base_identity
from scaletrain.observability import GoodputLedger
from scaletrain.parts import ResolvedRun
from scaletrain.train import Callback, StepOutcome, TrainState


class Saver:
    """Every rank's saves (collectives: every rank calls save() and commit_pending() at the same step)."""

    def __init__(
        self, resolved: ResolvedRun, engine, state: TrainState, ledger: GoodputLedger, writer: BackgroundWriter | None
    ):
        self.resolved, self.engine, self.state, self.ledger = resolved, engine, state, ledger
        self.writer = writer
        self.model_facts = resolved.model_facts  # what a checkpoint records of the model
        self._in_flight_step_s = 0.0  # the ledger's step seconds when the save in flight was taken

    def save(self, now: bool = False) -> Path | None:
        """A checkpoint of this step: committed before this returns (synchronous saves, or `now`: the end of the run,
        a preemption), or (--async_save) taken now, written in the background and committed at a later step
        boundary (commit_pending). Either way a save in flight is committed first: at most one at a time."""
        self.commit_pending(wait=True)
        cfg, ds, dist = self.resolved.cfg, self.resolved.ds, self.resolved.dist
        adapter_only = cfg.peft.use_peft  # LoRA: the base is not saved
        n_params, n_tensors = checkpoint_parameters(self.engine.module, adapter_only)
        if not adapter_only:
            n_params = self.resolved.n_params  # the whole model (a pipeline stage's module holds its layers alone)
        planned = planned_checkpoint_bytes(
            n_params, ds.precision, ds.zero_stage, dist.layout.tp, n_tensors, dist.world_size
        )
        facts, out, rank = self._model_facts(), cfg.run.output_dir, dist.rank
        if self.writer is not None and not now:
            start_checkpoint(self.engine, out, self.state, rank, self.writer, model_facts=facts, planned_bytes=planned)
            self._in_flight_step_s = self.ledger.attempt["step_s"]
            return None
        limit = cfg.checkpoint.save_total_limit
        path = save_checkpoint(self.engine, out, self.state, rank, limit, model_facts=facts, planned_bytes=planned)
        self.ledger.committed(self.state.step)
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
        step = writer and writer.in_flight and writer.in_flight.step  # None: nothing in flight
        limit = self.resolved.cfg.checkpoint.save_total_limit
        if step and settle_checkpoint(writer, self.resolved.dist.rank, limit, wait):
            self.ledger.committed(step, self._in_flight_step_s)

    def close(self) -> None:
        """A write still in flight here (a crash) is never committed."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class CommitInFlight(Callback):
    """After each step: commit a background save once every rank's write is done (before the step's record, so
    that a failed write is said before more is written)."""

    def __init__(self, saver: Saver):
        self.saver = saver

    def post_step(self, outcome: StepOutcome) -> None:
        self.saver.commit_pending()


class PeriodicSave(Callback):
    """A save every --save_steps steps, and once --save_interval_minutes have passed on any rank (the ranks' clocks
    differ: the step boundary agrees on it); not at the last step, which the end of the run saves."""

    def __init__(self, saver: Saver, save_steps: int, interval_minutes: float):
        self.saver, self.save_steps = saver, save_steps
        self.interval_s = 60 * interval_minutes
        self.last_save = time.monotonic()

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
