"""DeepSpeed's AutoTP: its tensor- and data-parallel groups built before deepspeed.initialize (the `mpu`), the TP
shards gathered into full weights on rank 0 for the Hugging Face export (engine.save_16bit_model writes the shards
under ZeRO-1/2), and AutoTP composed with the pipeline engine. Proven by tests/distributed/test_tensor_parallel.py::
test_tensor_parallel_matches_one_rank and tests/distributed/test_composed_layouts.py."""

from __future__ import annotations

from contextlib import contextmanager

from scaletrain.engine.ds_internals.guard import Hook, require

_TP, _TP_INSTEAD = "tensor parallelism (--tensor_parallel_size)", "train without --tensor_parallel_size"
TP_GROUPS = Hook("deepspeed.utils.groups", "_init_tp_mesh_device", _TP, _TP_INSTEAD)
TP_GATHER = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "_consolidated_16bit_state_dict", _TP, _TP_INSTEAD)
_TPP = "tensor x pipeline parallelism", "train with one of --tensor_parallel_size and --pipeline_parallel_size"
# AutoTP's groups are module globals of deepspeed.utils.groups; the engine builds them (a data x tensor mesh over the
# whole world) in _configure_tensor_parallel_states unless they are set, and then makes that module its `mpu`.
TP_GROUP_GLOBALS = tuple(
    Hook("deepspeed.utils.groups", name, *_TPP)
    for name in ("_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP")
)
TP_STATES = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "_configure_tensor_parallel_states", *_TPP)
# In training, AutoTP makes the LM head a column-parallel LinearLayer (a shard of the vocabulary's rows per tensor
# rank) that all-gathers the logits; the chunked loss computes from the shard instead (model/chunked_loss.py).
_HEAD = "the chunked loss under tensor parallelism", "run with --loss_chunk_size 0"
TP_HEAD = Hook("deepspeed.module_inject.layers", "LinearLayer", *_HEAD)
TP_HEAD_FIELDS = ("gather_output", "mp_group", "tp_index", "_partition_sizes")  # instance attributes, read below


def tensor_parallel_mpu(tensor_parallel_size: int):
    """AutoTP's tensor- and data-parallel groups (consecutive ranks per TP group), built before
    deepspeed.initialize; the returned module is the `mpu` that makes the engine count data-parallel ranks."""
    from deepspeed.utils import groups

    TP_GROUPS.on(groups)(tensor_model_parallel_size=tensor_parallel_size)
    return groups


def column_parallel_head(head) -> tuple | None:
    """(tensor-parallel group, the first vocabulary row of this rank's shard) when `head` is AutoTP's column-parallel
    LM head that gathers its logits (its training replacement); None for any other module."""
    layer_class = TP_HEAD.resolve()
    if type(head) is not layer_class:
        return None
    gather_output, group, index, sizes = (require(head, name, *_HEAD) for name in TP_HEAD_FIELDS)
    if not gather_output or group is None:
        return None
    return group, sum(sizes[:index])


def gathered_state_dict(engine) -> dict:
    """The full weights on rank 0 (every rank must call it: it gathers TP shards, and ZeRO-3 partitions)."""
    return TP_GATHER.on(engine)()


class GridWithTensorGroups:
    """The pipe grid as the engine's `mpu`, with the tensor-parallel getters AutoTP calls by other names: the grid's
    "slice" group is the tensor-parallel group (consecutive ranks), its "model parallel" group pipeline x tensor
    (where ZeRO-1 reduces the gradient norm), its data-parallel group one stage's replicas (where ZeRO-1 shards)."""

    def __init__(self, grid):
        self._grid = grid

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def get_tensor_model_parallel_group(self):
        return self._grid.get_slice_parallel_group()

    def get_tensor_model_parallel_src_rank(self):
        import torch.distributed as torch_dist

        return torch_dist.get_global_rank(self._grid.get_slice_parallel_group(), 0)


@contextmanager
def tensor_parallel_stages(grid):
    """While deepspeed.initialize builds a pipeline engine: AutoTP's groups are the pipe grid's (its tensor group
    the grid's slice group, its data-parallel group one stage's replicas), not the data x tensor mesh over the
    whole world that it would build, which would mix stages; and once AutoTP has split the stages, the engine's
    `mpu` is the grid again (with the tensor getters), so ZeRO-1, the gradient norm, the checkpoint files and the
    pipe schedule see every axis. DeepSpeed 0.19.8 replaces the grid with deepspeed.utils.groups, which has no
    pipeline group (the last stage fails at its first loss broadcast)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    for hook in TP_GROUP_GLOBALS:
        hook.on(groups)
    configure_states = TP_STATES.on(DeepSpeedEngine)
    # Kept for the engine's life: AutoTP's layers and its first-batch check read them at run time.
    groups._TENSOR_MODEL_PARALLEL_GROUP = grid.get_slice_parallel_group()
    groups._MODEL_PARALLEL_GROUP = grid.get_slice_parallel_group()
    groups._DATA_PARALLEL_GROUP = grid.get_data_parallel_group()

    def states_on_the_grid(engine, model):
        configure_states(engine, model)  # AutoTP's groups exist: its mesh is not built
        engine.mpu = GridWithTensorGroups(grid)

    DeepSpeedEngine._configure_tensor_parallel_states = states_on_the_grid
    try:
        yield
    finally:
        DeepSpeedEngine._configure_tensor_parallel_states = configure_states
