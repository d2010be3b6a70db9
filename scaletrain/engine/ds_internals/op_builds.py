"""DeepSpeed's op builders and torch's build directory, which engine/ops.py needs to load DeepSpeed's compiled ops
under its own lock (so a stale torch build lock cannot hang a run)."""

from __future__ import annotations

from scaletrain.engine.ds_internals.guard import Hook, check_version

_OPS = "loading DeepSpeed's compiled ops under scaletrain's build lock"
BUILD_DIRECTORY = Hook("torch.utils.cpp_extension", "_get_build_directory", _OPS)
INSTALLED_OPS = Hook("deepspeed.git_version_info", "installed_ops", _OPS)
CREATE_OP_BUILDER = Hook("deepspeed.accelerator.abstract_accelerator:DeepSpeedAccelerator", "create_op_builder", _OPS)
BUILDER_LOAD = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "load", _OPS)
BUILDER_COMPATIBLE = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "is_compatible", _OPS)
BUILDER_NAME = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "name", _OPS)  # on the instance only


def torch_build_directory(op_name: str) -> str:
    """Where torch.utils.cpp_extension builds (and caches) an op: torch's own rule, so the paths agree."""
    return BUILD_DIRECTORY.resolve()(op_name, verbose=False)


def create_op_builder(builder_name: str):
    """This accelerator's DeepSpeed op builder named `builder_name` (None where there is none), its API checked."""
    from deepspeed.accelerator import get_accelerator

    check_version()
    builder = CREATE_OP_BUILDER.on(get_accelerator())(builder_name)
    if builder is not None:
        for hook in (BUILDER_NAME, BUILDER_LOAD, BUILDER_COMPATIBLE):
            hook.on(builder)
    return builder


def op_preinstalled(builder) -> bool:
    """Whether the op was compiled into the DeepSpeed install (DS_BUILD_OPS=1): nothing to build or lock."""
    return bool(INSTALLED_OPS.resolve().get(builder.name, False))
