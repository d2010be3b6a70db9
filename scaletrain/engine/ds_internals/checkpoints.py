"""DeepSpeed's checkpoints: the universal checkpoint (the version scaletrain writes into every checkpoint, and the
ds_to_universal converter that reshards one for another rank count), and the record of every file a save writes,
with a failed write (a full disk) kept instead of raised so that the failing rank still reaches DeepSpeed's barriers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

from scaletrain.engine.ds_internals.guard import Hook

UNIVERSAL_CHECKPOINT_VERSION = 0.4  # the universal_checkpoint_info version DeepSpeed 0.19 writes and converts
_UNIVERSAL, _UNIVERSAL_INSTEAD = "resuming on another rank count", "resume with the rank count it was saved with"


def _not_ours(version: object) -> str | None:
    if version == UNIVERSAL_CHECKPOINT_VERSION:
        return None
    return f"is {version}, scaletrain writes {UNIVERSAL_CHECKPOINT_VERSION} into its checkpoints"


# Proven by tests/checkpoint/test_checkpoint.py::test_resume_on_another_rank_count_converts_and_continues.
UNIVERSAL_CONVERTER = Hook("deepspeed.checkpoint.ds_to_universal", None, _UNIVERSAL, _UNIVERSAL_INSTEAD)
UNIVERSAL_VERSION = Hook(
    "deepspeed.checkpoint.constants",
    "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
    _UNIVERSAL,
    _UNIVERSAL_INSTEAD,
    problem=_not_ours,
)
# Tensor x pipeline parallelism: AutoTP records how each parameter of its own stage is split (the module's
# universal_checkpoint_info, saved in every mp_rank file), and ds_to_universal reads only the first file's, so the
# other stages' parameters would be concatenated along dim 0 whatever their split. Proven by
# tests/distributed/test_composed_layouts.py::test_a_tensor_x_pipeline_checkpoint_resumes_exactly_on_other_layouts.
_STAGES = "resuming a tensor x pipeline checkpoint on another layout", "resume on the layout it was saved with"
UC_INFO_KEY = Hook("deepspeed.checkpoint.constants", "UNIVERSAL_CHECKPOINT_INFO", *_STAGES)
PIPELINE_REPLICATED_KEY = Hook("deepspeed.checkpoint.constants", "PIPELINE_REPLICATED_PARAMETER_PATTERNS", *_STAGES)
# The keys whose values are pattern lists (unions) and pattern dictionaries (merged) in that record.
_UC_LISTS = (
    "parameter_with_row_parallelism_patterns",
    "tp_replicated_parameter_patterns",
    "vocabulary_parameter_patterns",
    "parameter_to_average_patterns",
)
_UC_DICTS = ("autotp_unsupported_parameter_patterns", "sub_param_shard_widths")


def merge_stage_universal_info(engine) -> None:
    """Give this stage's module the union of every stage's universal_checkpoint_info (what each saved file then
    carries). Every rank calls it (an all-gather over the world), after deepspeed.initialize."""
    import torch.distributed as dist

    key = UC_INFO_KEY.resolve()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, getattr(engine.module, key, None) or {})
    setattr(engine.module, key, merged_universal_info(gathered, PIPELINE_REPLICATED_KEY.resolve()))


def merged_universal_info(infos: list, pipeline_replicated_key: str) -> dict:
    """One universal_checkpoint_info from the stages' (pattern lists joined, pattern dictionaries merged), with the
    tied modules' parameters (held by the first and the last stage) marked pipeline-replicated under
    `pipeline_replicated_key`, so the converter takes them once."""
    merged: dict = {}
    for info in infos:
        for name in _UC_LISTS:
            if name in info or name in merged:
                merged[name] = sorted(set(merged.get(name, [])) | set(info.get(name, [])))
        for name in _UC_DICTS:
            if name in info:
                merged[name] = {**merged.get(name, {}), **info[name]}
        subs = merged.setdefault("parameter_with_sub_params", [])
        subs += [sub for sub in info.get("parameter_with_sub_params", []) if sub not in subs]
        if "affine_map" in info:
            affine = merged.setdefault("affine_map", {**info["affine_map"], "params": {}})
            affine["params"] = {**affine["params"], **info["affine_map"].get("params", {})}
        for name in ("universal_checkpoint_version", "original_vocab_size"):
            if name in info:
                merged.setdefault(name, info[name])
    merged[pipeline_replicated_key] = [r"^tied_modules\."]
    return merged


# Every shard a save writes (checksummed into commit.json), and rank 0's copy of zero_to_fp32.py: proven by
# tests/checkpoint/test_checkpoint_integrity.py (a disk filled during a save, at 2 ranks).
_SAVE = "checksums and full-disk handling of checkpoint saves"
CHECKPOINT_WRITE = Hook("deepspeed.runtime.checkpoint_engine.checkpoint_engine:CheckpointEngine", "save", _SAVE)
RECOVERY_SCRIPT = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "_copy_recovery_script", _SAVE)


def universal_checkpoint_info(tensor_parallel_size: int = 1) -> dict:
    """The client-state entry that lets ds_to_universal convert a checkpoint for another rank count. Under tensor
    parallelism AutoTP records its own (how each parameter is split), and the client state would overwrite it: then
    ds_to_universal merges the shards wrongly without an error. So none is added there."""
    if tensor_parallel_size > 1:
        return {}
    return {"universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION}}


def universal_conversion_command(ckpt, out) -> list[str]:
    """The command that converts checkpoint folder `ckpt` into a universal checkpoint in `out`."""
    module = UNIVERSAL_CONVERTER.resolve()
    return [
        sys.executable,
        "-m",
        module,
        "--input_folder",
        str(ckpt),
        "--output_folder",
        str(out),
        "--inject_missing_state",
    ]


@dataclass
class CheckpointWrites:
    """What one rank wrote during engine.save_checkpoint: the files, and the first write that failed (or None)."""

    paths: list = field(default_factory=list)
    failed: tuple | None = None  # (path, exception)


@contextmanager
def recorded_checkpoint_writes(
    engine, is_write_failure: Callable[[BaseException], bool], write: Callable | None = None
) -> Iterator[CheckpointWrites]:
    """Record this rank's checkpoint files while DeepSpeed saves. A write failure (`is_write_failure`: a full disk)
    is kept instead of raised, and later writes are skipped: raising would leave this rank out of the barriers that
    DeepSpeed's save_checkpoint runs after the writes, with the other ranks waiting in them for ever. `write`
    (state_dict, path, zipfile_serialization), where given, takes each file's state dict instead of DeepSpeed's
    checkpoint engine (an asynchronous save's snapshot)."""
    writes = CheckpointWrites()
    checkpoint_engine = engine.checkpoint_engine
    if write is None:
        write = CHECKPOINT_WRITE.on(checkpoint_engine)
    else:
        CHECKPOINT_WRITE.on(checkpoint_engine)  # the same version check: DeepSpeed still writes through save()
        write = partial(write, zipfile_serialization=getattr(checkpoint_engine, "zipfile_serialization", True))
    copy_script = RECOVERY_SCRIPT.on(engine)

    def guarded(action: Callable[..., object], where: str, *args: object, **kwargs: object) -> bool:
        if writes.failed is not None:
            return False
        try:
            action(*args, **kwargs)
        except (OSError, RuntimeError) as err:
            if not is_write_failure(err):
                raise
            writes.failed = (str(where), err)
            return False
        return True

    def save(state_dict, path, *args, **kwargs):
        if guarded(write, path, state_dict, path, *args, **kwargs):
            writes.paths.append(str(path))

    def copy_recovery_script(save_path, *args, **kwargs):  # its files are not recorded: rank 0 hashes those
        guarded(copy_script, save_path, save_path, *args, **kwargs)

    checkpoint_engine.save, engine._copy_recovery_script = save, copy_recovery_script
    try:
        yield writes
    finally:
        del checkpoint_engine.save, engine._copy_recovery_script  # the class's methods again


def separate_step_counters(engine) -> int:
    """After a universal-checkpoint load: each optimizer state gets its own Adam step counter; returns how many were
    shared. DeepSpeed 0.19.8's ZeRO-3 loader (stage3.py, _load_universal_checkpoint) puts one `step` tensor into the
    state of every sub-group's fp32 partition, and torch's Adam increments a tensor step in place once per
    parameter it updates: the shared counter then advanced by the number of sub-groups per update (2 with the
    weight-decay groups), and the bias correction drifted from the run being continued."""
    import torch

    state = getattr(getattr(engine.optimizer, "optimizer", None), "state", None) or {}
    seen, separated = set(), 0
    for values in state.values():
        step = values.get("step") if isinstance(values, dict) else None
        if not torch.is_tensor(step):
            continue
        if id(step) in seen:
            values["step"] = step.clone()
            separated += 1
        seen.add(id(step))
    return separated
