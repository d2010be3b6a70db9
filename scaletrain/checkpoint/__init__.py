"""Checkpoints: the checkpoint manager (a checkpoint's whole life in a run, and the loop's checkpoint callback), the
commit protocol over DeepSpeed's sharded save, resume (with universal conversion), the Hugging Face export, and
publishing to the hub.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.checkpoint.commit import clear_previous_run
from scaletrain.checkpoint.final_export import FinalExport
from scaletrain.checkpoint.manager import CheckpointManager, Checkpointing, CheckpointSettings, SaveSchedule
from scaletrain.checkpoint.publish import check_push_target, publish_export, reply_end_ids
from scaletrain.checkpoint.resume_point import plan_resume, verify_resume
from scaletrain.checkpoint.run_folder import MODEL_CONFIG_FILE, write_run_folder

__all__ = [
    "MODEL_CONFIG_FILE",
    "CheckpointManager",
    "Checkpointing",
    "FinalExport",
    "CheckpointSettings",
    "SaveSchedule",
    "check_push_target",
    "clear_previous_run",
    "publish_export",
    "reply_end_ids",
    "plan_resume",
    "write_run_folder",
    "verify_resume",
]
