"""Checkpoints: the commit protocol over DeepSpeed's sharded save, resume (with universal conversion), the Hugging
Face export, and publishing to the hub.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.checkpoint.commit import (
    clear_previous_run,
    committed_step,
    newest_committed,
    verified_resume_checkpoint,
)
from scaletrain.checkpoint.export import export_hf_model
from scaletrain.checkpoint.publish import check_push_target, complete_export, publish_export, reply_end_ids
from scaletrain.checkpoint.resume import (
    check_resumable,
    ensure_universal,
    load_checkpoint,
    offload_setting,
    read_train_state,
    resolve_resume,
    saved_zero_stage,
)
from scaletrain.checkpoint.async_save import BackgroundWriter
from scaletrain.checkpoint.rollback import roll_back
from scaletrain.checkpoint.save import (
    checkpoint_parameters,
    planned_checkpoint_bytes,
    save_checkpoint,
    background_writer,
    settle_checkpoint,
    snapshot_bytes_per_rank,
    start_checkpoint,
)

__all__ = [
    "BackgroundWriter",
    "background_writer",
    "check_push_target",
    "check_resumable",
    "checkpoint_parameters",
    "clear_previous_run",
    "committed_step",
    "complete_export",
    "ensure_universal",
    "export_hf_model",
    "load_checkpoint",
    "newest_committed",
    "offload_setting",
    "planned_checkpoint_bytes",
    "publish_export",
    "read_train_state",
    "reply_end_ids",
    "resolve_resume",
    "roll_back",
    "save_checkpoint",
    "settle_checkpoint",
    "snapshot_bytes_per_rank",
    "start_checkpoint",
    "saved_zero_stage",
    "verified_resume_checkpoint",
]
