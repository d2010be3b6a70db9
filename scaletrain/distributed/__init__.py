"""Distributed facts: the launch and world (DistInfo, process groups), the parallel layout, pipeline and sequence
parallelism, and how ranks agree before they train together.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.distributed.agreement import preflight_facts, settle, stop_with_the_others, store_facts
from scaletrain.distributed.layout import (
    check_model_layout,
    check_tensor_groups_within_nodes,
    check_pipeline_layout,
    check_sequence_layout,
    layout_ds_keys,
    place_ranks,
)
from scaletrain.distributed.pipeline import (
    LAYER_MAP,
    TokenLoss,
    build_pipeline_module,
    hf_state_dict_from_layer_files,
    layer_map,
    pipe_micro_batches,
    rename_universal_parameters,
)
from scaletrain.distributed.sequence_parallel import register_ulysses, sequence_shard
from scaletrain.distributed.world import (
    all_gather_objects,
    any_rank,
    max_over_ranks,
    barrier,
    broadcast_from_main,
    communication_threads,
    describe_launch,
    every_rank,
    init_distributed,
    read_launch_env,
    process_group_timeout,
    teardown_distributed,
    use_shm_allreduce,
)

__all__ = [
    "LAYER_MAP",
    "TokenLoss",
    "all_gather_objects",
    "any_rank",
    "every_rank",
    "max_over_ranks",
    "barrier",
    "broadcast_from_main",
    "build_pipeline_module",
    "check_model_layout",
    "check_pipeline_layout",
    "check_sequence_layout",
    "layout_ds_keys",
    "check_tensor_groups_within_nodes",
    "communication_threads",
    "describe_launch",
    "hf_state_dict_from_layer_files",
    "init_distributed",
    "layer_map",
    "pipe_micro_batches",
    "place_ranks",
    "preflight_facts",
    "read_launch_env",
    "register_ulysses",
    "rename_universal_parameters",
    "sequence_shard",
    "settle",
    "stop_with_the_others",
    "store_facts",
    "process_group_timeout",
    "teardown_distributed",
    "use_shm_allreduce",
]
