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
from scaletrain.checkpoint.resume import ensure_universal, load_checkpoint
from scaletrain.checkpoint.resume_point import plan_resume, resume_elsewhere
from scaletrain.checkpoint.rollback import roll_back
from scaletrain.checkpoint.run_folder import read_run_config, write_run_folder
from scaletrain.checkpoint.saver import CommitInFlight, PeriodicSave, Saver
from scaletrain.checkpoint.save import background_writer

__all__ = [
    "CommitInFlight",
    "PeriodicSave",
    "Saver",
    "background_writer",
    "check_push_target",
    "clear_previous_run",
    "committed_step",
    "complete_export",
    "ensure_universal",
    "export_hf_model",
    "load_checkpoint",
    "newest_committed",
    "publish_export",
    "reply_end_ids",
    "plan_resume",
    "read_run_config",
    "resume_elsewhere",
    "roll_back",
    "write_run_folder",
    "verified_resume_checkpoint",
]
