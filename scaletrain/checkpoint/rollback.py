"""The non-finite guard's rollback (--max_consecutive_skips): back to the newest committed checkpoint, with the data
position moved past the streak of bad batches."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from scaletrain.checkpoint.commit import newest_committed
from scaletrain.errors import NonFiniteStop
from scaletrain.parts import DistInfo, ResumePoint
from scaletrain.train import TrainState

log = logging.getLogger(__name__)


def roll_back(
    *,
    state: TrainState,
    output_dir: str,
    dist: DistInfo,
    resume: ResumePoint | None,
    load: Callable[[Path, bool], None],
) -> dict:
    """Every rank: load the newest committed checkpoint of `output_dir` (chosen by rank 0), keep the data moving
    forward (the next step trains on the batch after the streak, nothing is replayed); the jump's entry for the
    non-finite ledger. `resume`: the checkpoint this run started from. `load(checkpoint, universal)`: the checkpoint
    manager's load (the train state, what the run redoes after a load, the carried parts' state)."""
    from scaletrain.distributed import broadcast_from_main

    # Chosen once, by rank 0: ranks scanning a shared folder at different moments could load different steps.
    newest = broadcast_from_main(newest_committed(output_dir) if dist.is_main else None)
    if newest is None:
        raise NonFiniteStop(
            f"step {state.step}: {state.consecutive_skips} updates skipped in a row and no "
            "committed checkpoint to roll back to; lower the learning rate or check the data "
            f"(the samples are in {output_dir}/nonfinite_ledger.jsonl), and use "
            "--save_steps so a rollback has a checkpoint"
        )
    data_step, position, from_step = state.step + state.data_offset, state.samples_seen, state.step
    skips = state.consecutive_skips
    # The checkpoint this run started from on another layout loads through its universal form.
    universal = resume is not None and resume.reshard and newest == resume.checkpoint
    load(newest, universal)
    state.data_offset = data_step - state.step  # the next step trains on the batch after the streak
    state.samples_seen = position  # the data position keeps moving forward: nothing is replayed
    state.consecutive_skips = 0
    log.warning(
        f"rolled back to {newest} (step {state.step}) after {skips} skipped updates in a row; training continues with "
        f"the data after step {from_step}"
    )
    return {
        "step": from_step,
        "event": "rollback",
        "to_checkpoint": newest.name,
        "to_step": state.step,
        "data_offset": state.data_offset,
    }
