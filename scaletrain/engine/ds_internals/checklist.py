"""Every hook that check_hooks() resolves from its class or module, without an engine, from every area module (the
instance-only ones are checked where they are used); tests/engine/test_ds_internals.py runs it, so an upgrade that moves
one fails there first."""

from __future__ import annotations

from scaletrain.errors import UsageError

from scaletrain.engine.ds_internals.checkpoints import (
    CHECKPOINT_WRITE,
    PIPELINE_REPLICATED_KEY,
    RECOVERY_SCRIPT,
    UC_INFO_KEY,
    UNIVERSAL_CONVERTER,
    UNIVERSAL_VERSION,
)
from scaletrain.engine.ds_internals.comm import (
    BACKEND_ALL_REDUCE,
    COMM_BACKEND,
    COMMS_APPEND,
    COMMS_LOGGER,
    COMMS_MSG_SIZE,
    SHM_BUILD,
)
from scaletrain.engine.ds_internals.config_models import CONFIG_MODELS
from scaletrain.engine.ds_internals.guard import DeepSpeedInternalsMoved
from scaletrain.engine.ds_internals.op_builds import (
    BUILD_DIRECTORY,
    BUILDER_COMPATIBLE,
    BUILDER_LOAD,
    CPU_INFO,
    CREATE_OP_BUILDER,
    INSTALLED_OPS,
)
from scaletrain.engine.ds_internals.optimizer import STAGE3_CHECK, STAGE3_CLEANUP, STAGE12_CHECK, STAGE12_INIT
from scaletrain.engine.ds_internals.pipeline import (
    PIPE_BUILD,
    PIPE_CLIP,
    PIPE_INSTRUCTIONS,
    PIPE_OPTIMIZER_STEP,
    PIPE_WAITS,
    PIPE_WORK,
)
from scaletrain.engine.ds_internals.release import (
    FWD_MODULE_STACK,
    PARAMS_TO_RELEASE,
    PIPE_P2P_GRID,
    PIPE_P2P_GROUPS,
    ULYSSES_GROUPS,
)
from scaletrain.engine.ds_internals.tensor_parallel import TP_GATHER, TP_GROUP_GLOBALS, TP_GROUPS, TP_HEAD, TP_STATES

# What check_hooks() resolves from the classes; the instance-only ones are checked where they are used.
HOOKS = (
    STAGE3_CHECK,
    STAGE3_CLEANUP,
    STAGE12_CHECK,
    STAGE12_INIT,
    FWD_MODULE_STACK,
    PARAMS_TO_RELEASE,
    BUILD_DIRECTORY,
    INSTALLED_OPS,
    CREATE_OP_BUILDER,
    BUILDER_LOAD,
    BUILDER_COMPATIBLE,
    CPU_INFO,
    SHM_BUILD,
    COMM_BACKEND,
    BACKEND_ALL_REDUCE,
    UNIVERSAL_CONVERTER,
    UNIVERSAL_VERSION,
    UC_INFO_KEY,
    PIPELINE_REPLICATED_KEY,
    TP_GROUPS,
    TP_GATHER,
    *TP_GROUP_GLOBALS,
    TP_STATES,
    TP_HEAD,
    PIPE_INSTRUCTIONS,
    PIPE_OPTIMIZER_STEP,
    PIPE_CLIP,
    PIPE_BUILD,
    *PIPE_WAITS,
    *PIPE_WORK,
    PIPE_P2P_GROUPS,
    PIPE_P2P_GRID,
    ULYSSES_GROUPS,
    COMMS_LOGGER,
    COMMS_APPEND,
    COMMS_MSG_SIZE,
    CHECKPOINT_WRITE,
    RECOVERY_SCRIPT,
    *CONFIG_MODELS.values(),
)


def check_hooks() -> list[str]:
    """Resolve every hook against the installed DeepSpeed and torch, without an engine; the names checked."""
    for hook in HOOKS:
        hook.resolve()
    return [hook.where for hook in HOOKS]


def check_deepspeed_hooks() -> None:
    """The pre-flight's check of the installed DeepSpeed: a hook that moved ends the run with one line and exit
    code 2, before anything is built, instead of a crash deep inside the first step or the first save."""
    try:
        check_hooks()
    except DeepSpeedInternalsMoved as err:
        raise UsageError(
            str(err), "pip install -r requirements.txt installs the DeepSpeed these hooks were checked against"
        ) from None
