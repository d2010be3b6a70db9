"""The DeepSpeed engine: deepspeed.initialize with parameter groups, the LR schedules, DeepSpeed's compiled ops, and
the one place that touches DeepSpeed internals (version-guarded).

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.engine.ds_internals import (
    check_deepspeed_hooks,
    deepspeed_config_models,
    ShmAllReduce,
    SkipSwitch,
    InstructionTimes,
    before_pipeline_update,
    column_parallel_head,
    gathered_state_dict,
    per_op_comm_latencies,
    pipeline_module_class,
    recorded_checkpoint_writes,
    release_other_stages,
    release_sequence_group,
    skip_shm_op_build,
    universal_checkpoint_info,
    universal_conversion_command,
    time_pipeline_instructions,
)
from scaletrain.engine.initialize import (
    build_engine,
    check_compile,
    compile_engine,
    compile_requested,
    release_engine,
    repair_universal_load,
)
from scaletrain.engine.ops import comm_ops, load_ops
from scaletrain.engine.schedules import LRSchedule, describe_schedule_change, restart_schedule, schedule_for

__all__ = [
    "check_deepspeed_hooks",
    "deepspeed_config_models",
    "LRSchedule",
    "ShmAllReduce",
    "SkipSwitch",
    "InstructionTimes",
    "before_pipeline_update",
    "build_engine",
    "check_compile",
    "column_parallel_head",
    "comm_ops",
    "compile_engine",
    "compile_requested",
    "describe_schedule_change",
    "gathered_state_dict",
    "load_ops",
    "per_op_comm_latencies",
    "pipeline_module_class",
    "recorded_checkpoint_writes",
    "release_engine",
    "release_other_stages",
    "release_sequence_group",
    "restart_schedule",
    "repair_universal_load",
    "skip_shm_op_build",
    "universal_checkpoint_info",
    "universal_conversion_command",
    "schedule_for",
    "time_pipeline_instructions",
]
