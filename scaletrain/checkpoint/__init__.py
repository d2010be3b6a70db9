"""Checkpoints: the commit protocol over DeepSpeed's sharded save, resume (with universal conversion), the Hugging
Face export, and publishing to the hub.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.checkpoint.commit import clear_previous_run, verified_resume_checkpoint
from scaletrain.checkpoint.final_export import FinalExport
from scaletrain.checkpoint.publish import check_push_target, publish_export, reply_end_ids
from scaletrain.checkpoint.resume import ensure_universal, load_checkpoint
from scaletrain.checkpoint.resume_point import plan_resume, resume_elsewhere
from scaletrain.checkpoint.rollback import roll_back
from scaletrain.checkpoint.run_folder import write_run_folder
from scaletrain.checkpoint.saver import CommitInFlight, PeriodicSave, Saver, SaveSettings
from scaletrain.checkpoint.save import background_writer

__all__ = [
    "CommitInFlight",
    "FinalExport",
    "PeriodicSave",
    "Saver",
    "SaveSettings",
    "background_writer",
    "check_push_target",
    "clear_previous_run",
    "ensure_universal",
    "load_checkpoint",
    "publish_export",
    "reply_end_ids",
    "plan_resume",
    "resume_elsewhere",
    "roll_back",
    "write_run_folder",
    "verified_resume_checkpoint",
]
