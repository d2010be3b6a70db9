"""DeepSpeed's AutoTP: its tensor- and data-parallel groups built before deepspeed.initialize (the `mpu`), and the
TP shards gathered into full weights on rank 0 for the Hugging Face export (engine.save_16bit_model writes the shards
under ZeRO-1/2). Proven by tests/distributed/test_tensor_parallel.py::test_tensor_parallel_matches_one_rank."""

from __future__ import annotations

from scaletrain.engine.ds_internals.guard import Hook

_TP, _TP_INSTEAD = "tensor parallelism (--tensor_parallel_size)", "train without --tensor_parallel_size"
TP_GROUPS = Hook("deepspeed.utils.groups", "_init_tp_mesh_device", _TP, _TP_INSTEAD)
TP_GATHER = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "_consolidated_16bit_state_dict", _TP, _TP_INSTEAD)


def tensor_parallel_mpu(tensor_parallel_size: int):
    """AutoTP's tensor- and data-parallel groups (consecutive ranks per TP group), built before
    deepspeed.initialize; the returned module is the `mpu` that makes the engine count data-parallel ranks."""
    from deepspeed.utils import groups

    TP_GROUPS.on(groups)(tensor_model_parallel_size=tensor_parallel_size)
    return groups


def gathered_state_dict(engine) -> dict:
    """The full weights on rank 0 (every rank must call it: it gathers TP shards, and ZeRO-3 partitions)."""
    return TP_GATHER.on(engine)()
