"""The one place scaletrain touches DeepSpeed (and torch) internals: private names, module globals, class caches.

Each hook below was checked against the versions in CHECKED_DEEPSPEED_VERSIONS (and CHECKED_TORCH_VERSIONS for the
torch one). A hook that is gone raises DeepSpeedInternalsMoved, one line naming the missing `module.attribute`, what
it is for, and what to do; nothing falls back silently. `check_hooks()` resolves them all without an engine
(tests/test_ds_internals.py runs it, so an upgrade that moves one fails there first).

Hooks, why we need them, and the test that proves they still act:

- ZeRO-3 DeepSpeedZeroOptimizer_Stage3._overflow_check_and_loss_scale_update, ._loss_scale_update_and_overflow_cleanup
  and .overflow: --on_nonfinite skip discards an update through DeepSpeed's own fp16 overflow path (SkipSwitch).
  tests/test_nonfinite.py::test_a_nan_on_one_rank_skips_the_update_on_every_rank[zero3,zero3_offload].
- ZeRO-1/2 DeepSpeedZeroOptimizer.check_overflow, .check_grad_overflow (an __init__ argument kept on the instance)
  and .overflow: the same for stages 1 and 2. The same test [zero1,zero2_offload], and the rollback test (zero2).
- deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK and the class-wide functools.lru_cache on
  PartitionedParameterCoordinator.__params_to_release: both keep a ZeRO-3 engine's modules (and the process groups
  they hold) alive after engine.destroy(), until the interpreter exits, where gloo's threads can abort a finished run.
  deepspeed.runtime.pipe.p2p._groups and ._grid do the same for a pipeline engine's groups.
  tests/test_pipeline.py::test_a_run_frees_its_process_groups_before_exit[zero3-*, zero1_pp2-*].
- torch.utils.cpp_extension._get_build_directory (torch's rule for where an op is built), deepspeed.git_version_info
  .installed_ops, the accelerator's create_op_builder and OpBuilder.load/.is_compatible/.name: engine/ops.py loads
  DeepSpeed's compiled ops under its own lock, so a stale torch build lock cannot hang a run.
  tests/test_ops.py::test_stale_build_locks_are_removed_and_a_two_rank_offload_run_finishes.
- deepspeed.comm.torch.build_shm_op: replaced by a no-op on a single CPU rank, which never communicates, to skip a
  build of minutes. Only speed depends on it; tests/test_ds_internals.py checks that it resolves.
- deepspeed.comm.comm.cdb (the process group backend DeepSpeed's collectives go through), its instance method
  all_reduce and attributes shm_comm_op and shm_vector_kernel_level, and the op
  torch.ops.deepspeed.inference_all_reduce_ (DeepSpeed's shared-memory all-reduce of CPU ranks on one host, built
  for inference): --cpu_shm_allreduce sends large synchronous sums over the whole world through it instead of gloo.
  tests/test_pipeline.py::test_loss_and_update_do_not_depend_on_accumulation_or_rank_count (its 2-rank run).
- deepspeed.checkpoint.ds_to_universal (run with python -m) and its checkpoint version
  deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE (scaletrain writes 0.4 into every checkpoint):
  resuming on another rank count. tests/test_checkpoint.py::test_resume_on_another_rank_count_converts_and_continues.
- deepspeed.utils.groups._init_tp_mesh_device (builds AutoTP's tensor- and data-parallel groups before
  deepspeed.initialize, so that the engine's batch arithmetic counts data-parallel ranks, not the world; the module is
  then the `mpu`) and DeepSpeedEngine._consolidated_16bit_state_dict (gathers the TP shards into full weights on
  rank 0 for the Hugging Face export; engine.save_16bit_model writes the shards under ZeRO-1/2).
  tests/test_tensor_parallel.py::test_tensor_parallel_matches_one_rank.
- PipelineEngine._INSTRUCTION_MAP (the schedule's instruction -> method table; an instance copy replaces its
  OptimizerStep entry): the pipeline's step-boundary agreement (global loss, preemption, the non-finite guard) runs
  right before the update, inside train_batch. DeepSpeedEngine.clip_fp32_gradients (with the pipe grid's public
  get_pipe_parallel_group and the module's tied_comms): under ZeRO-0, DeepSpeed 0.19.8 computes the clipping norm
  with the pipe grid as `mpu`, whose "model parallel rank" is the stage, so only stage 0's gradients enter the
  norm and every stage clips by it; scaletrain replaces it with the norm over every stage.
  tests/test_pipeline_parallel.py (ZeRO-0 against one rank, gradient clipping acting).
  PipelineModule._layer_specs / _local_start / _local_stop: the specs of other stages' layers hold the Hugging Face
  modules they wrap; they are emptied so those modules are freed.
- deepspeed.comm.comm.comms_logger, CommsLogger.append and .comms_dict: DeepSpeed 0.19.8 hands append the running
  total of every op of a name so far (timed_op reads its timer with reset=False) as the op's latency; --comms_log
  replaces the instance's append with one that keeps each op's own time (and refuses a total that shrinks: a
  fixed DeepSpeed). tests/test_comm_log.py (per-op latencies against wall-clock times of known collectives, and
  that DeepSpeed's own figures are still running totals).
- engine.checkpoint_engine.save (every shard DeepSpeed writes, on an instance) and
  DeepSpeedEngine._copy_recovery_script (rank 0's copy of zero_to_fp32.py): recorded_checkpoint_writes keeps each
  rank's list of written files (checksummed into commit.json) and turns a failed write (a full disk) into a recorded
  error instead of a raise, so that the failing rank still reaches DeepSpeed's barriers inside save_checkpoint with
  the others. tests/test_checkpoint_integrity.py (a disk filled during a save, at 2 ranks).

Importing this module imports neither torch nor DeepSpeed; each function imports what it touches.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CHECKED_DEEPSPEED_VERSIONS = ("0.19.8",)
CHECKED_TORCH_VERSIONS = ("2.13.0",)  # only for torch.utils.cpp_extension._get_build_directory
UNIVERSAL_CHECKPOINT_VERSION = 0.4  # the universal_checkpoint_info version DeepSpeed 0.19 writes and converts

_CHECKED = {"deepspeed": ("DeepSpeed", CHECKED_DEEPSPEED_VERSIONS), "torch": ("torch", CHECKED_TORCH_VERSIONS)}
_MISSING = object()
_version_checked = False


class DeepSpeedInternalsMoved(RuntimeError):
    """A DeepSpeed (or torch) internal that scaletrain hooks is gone or changed: the installed version differs."""


def check_version() -> str | None:
    """Warn once per process when the installed DeepSpeed is not one the hooks were checked against; the warning."""
    global _version_checked
    if _version_checked:
        return None
    _version_checked = True
    import deepspeed

    installed = deepspeed.__version__
    if installed.split("+")[0] in CHECKED_DEEPSPEED_VERSIONS:
        return None
    message = (
        f"DeepSpeed {installed} is not a version scaletrain's DeepSpeed hooks were checked against "
        f"({', '.join(CHECKED_DEEPSPEED_VERSIONS)}): a hook that moved stops the run with "
        f"DeepSpeedInternalsMoved; pin deepspeed=={CHECKED_DEEPSPEED_VERSIONS[-1]} to be safe"
    )
    log.warning(message)
    return message


def _dotted(obj: Any) -> str:
    if isinstance(obj, type(sys)):
        return obj.__name__
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def moved(where: str, problem: str, purpose: str, instead: str = "") -> DeepSpeedInternalsMoved:
    """The one-line error for the internal `where` (a dotted name); `problem` says what is wrong ("is missing")."""
    library = where.split(".")[0]
    if library not in _CHECKED:  # e.g. DeepSpeed's op builders, importable as a top-level `op_builder` package
        library = "deepspeed"
    label, checked = _CHECKED[library]
    installed = getattr(sys.modules.get(library), "__version__", "(not importable)")
    todo = f"install {library}=={checked[-1]}" + (f", or {instead}" if instead else "")
    return DeepSpeedInternalsMoved(
        f"{label} {installed}: {where} {problem}, which scaletrain needs for {purpose} (checked against {label} "
        f"{', '.join(checked)}); {todo}, or update scaletrain/engine/ds_internals.py"
    )


def require(owner: Any, name: str, purpose: str, instead: str = "") -> Any:
    """`owner.name` (owner: a module, class or instance), or DeepSpeedInternalsMoved naming it and its purpose."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        raise moved(f"{_dotted(owner)}.{name}", "is missing", purpose, instead)
    return value


@dataclass(frozen=True)
class Hook:
    """One internal: `owner` is "package.module" or "package.module:Class"; `name` its attribute, or None when the
    owner is a module that must exist to be run with `python -m`. `problem` tells what is wrong with a found value."""

    owner: str
    name: str | None
    purpose: str
    instead: str = ""
    problem: Callable[[Any], str | None] | None = None

    @property
    def where(self) -> str:
        return self.owner.replace(":", ".") + (f".{self.name}" if self.name else "")

    def resolve(self) -> Any:
        """The attribute, looked up from its owner (importing it), checked."""
        if self.name is None:
            return self._find_module()
        return self.on(self.owner_object())

    def owner_object(self) -> Any:
        """The owner module or class (imported)."""
        module_name, _, class_name = self.owner.partition(":")
        if module_name.split(".")[0] == "deepspeed":
            check_version()
        try:
            owner = importlib.import_module(module_name)
        except ImportError as err:
            raise moved(module_name, f"cannot be imported ({err})", self.purpose, self.instead) from err
        return require(owner, class_name, self.purpose, self.instead) if class_name else owner

    def on(self, obj: Any) -> Any:
        """The attribute looked up on `obj` (an instance of the owner class, or the owner itself), checked."""
        value = require(obj, self.name, self.purpose, self.instead)
        problem = self.problem(value) if self.problem else None
        if problem:
            raise moved(f"{_dotted(obj)}.{self.name}", problem, self.purpose, self.instead)
        return value

    def _find_module(self) -> str:
        module_name = self.owner
        if module_name.split(".")[0] == "deepspeed":
            check_version()
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            raise moved(module_name, "is missing", self.purpose, self.instead)
        return module_name


def _caches(function: Any) -> list:
    """Every functools cache in `function` or inside its decorators' closures."""
    found, pending, seen = [], [function], set()
    while pending:
        current = pending.pop()
        if id(current) in seen or not callable(current):
            continue
        seen.add(id(current))
        if hasattr(current, "cache_clear"):
            found.append(current)
        for cell in getattr(current, "__closure__", None) or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                pass
        if hasattr(current, "__wrapped__"):
            pending.append(current.__wrapped__)
    return found


def _no_cache(function: Any) -> str | None:
    # If DeepSpeed dropped the cache, the leak it caused may be fixed: say so rather than clear nothing in silence.
    return None if _caches(function) else "no longer carries a functools cache (if the leak is fixed, drop this hook)"


def _no_check_grad_overflow(init: Any) -> str | None:
    import inspect

    # An instance attribute, set from this argument: the class itself cannot show it.
    if "check_grad_overflow" in inspect.signature(init).parameters:
        return None
    return "no longer takes check_grad_overflow (the instance flag SkipSwitch sets)"


def _not_ours(version: Any) -> str | None:
    if version == UNIVERSAL_CHECKPOINT_VERSION:
        return None
    return f"is {version}, scaletrain writes {UNIVERSAL_CHECKPOINT_VERSION} into its checkpoints"


_SKIP, _SKIP_INSTEAD = "--on_nonfinite skip", "use --on_nonfinite stop"
_RELEASE = "freeing a ZeRO-3 engine's process groups before exit"
_OPS = "loading DeepSpeed's compiled ops under scaletrain's build lock"
_UNIVERSAL, _UNIVERSAL_INSTEAD = "resuming on another rank count", "resume with the rank count it was saved with"
_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"

STAGE3_CHECK = Hook(_STAGE3, "_overflow_check_and_loss_scale_update", _SKIP, _SKIP_INSTEAD)
STAGE3_CLEANUP = Hook(_STAGE3, "_loss_scale_update_and_overflow_cleanup", _SKIP, _SKIP_INSTEAD)
STAGE12_CHECK = Hook(_STAGE12, "check_overflow", _SKIP, _SKIP_INSTEAD)
STAGE12_INIT = Hook(_STAGE12, "__init__", _SKIP, _SKIP_INSTEAD, problem=_no_check_grad_overflow)
STAGE12_CHECKED = Hook(_STAGE12, "check_grad_overflow", _SKIP, _SKIP_INSTEAD)  # on the instance only
OVERFLOW = Hook(_STAGE12, "overflow", _SKIP, _SKIP_INSTEAD)  # on the instance only (either ZeRO optimizer)
FWD_MODULE_STACK = Hook("deepspeed.runtime.zero.parameter_offload", "FWD_MODULE_STACK", _RELEASE)
PARAMS_TO_RELEASE = Hook(
    "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator",
    "_PartitionedParameterCoordinator__params_to_release",
    _RELEASE,
    problem=_no_cache,
)
BUILD_DIRECTORY = Hook("torch.utils.cpp_extension", "_get_build_directory", _OPS)
INSTALLED_OPS = Hook("deepspeed.git_version_info", "installed_ops", _OPS)
CREATE_OP_BUILDER = Hook("deepspeed.accelerator.abstract_accelerator:DeepSpeedAccelerator", "create_op_builder", _OPS)
BUILDER_LOAD = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "load", _OPS)
BUILDER_COMPATIBLE = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "is_compatible", _OPS)
BUILDER_NAME = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "name", _OPS)  # on the instance only
SHM_BUILD = Hook("deepspeed.comm.torch", "build_shm_op", "skipping the shm all-reduce build on one CPU rank")
_SHM, _SHM_INSTEAD = "the shared-memory all-reduce of CPU ranks (--cpu_shm_allreduce)", "pass --no-cpu_shm_allreduce"
COMM_BACKEND = Hook("deepspeed.comm.comm", "cdb", _SHM, _SHM_INSTEAD)
BACKEND_ALL_REDUCE = Hook("deepspeed.comm.torch:TorchBackend", "all_reduce", _SHM, _SHM_INSTEAD)
SHM_KERNEL_LEVEL = Hook("deepspeed.comm.torch:TorchBackend", "shm_vector_kernel_level", _SHM, _SHM_INSTEAD)  # instance
SHM_COMM_OP = Hook("deepspeed.comm.torch:TorchBackend", "shm_comm_op", _SHM, _SHM_INSTEAD)  # instance
UNIVERSAL_CONVERTER = Hook("deepspeed.checkpoint.ds_to_universal", None, _UNIVERSAL, _UNIVERSAL_INSTEAD)
UNIVERSAL_VERSION = Hook(
    "deepspeed.checkpoint.constants",
    "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
    _UNIVERSAL,
    _UNIVERSAL_INSTEAD,
    problem=_not_ours,
)
_TP, _TP_INSTEAD = "tensor parallelism (--tensor_parallel_size)", "train without --tensor_parallel_size"
TP_GROUPS = Hook("deepspeed.utils.groups", "_init_tp_mesh_device", _TP, _TP_INSTEAD)
TP_GATHER = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "_consolidated_16bit_state_dict", _TP, _TP_INSTEAD)

_PP, _PP_INSTEAD = "pipeline parallelism (--pipeline_parallel_size)", "train without --pipeline_parallel_size"
PIPE_INSTRUCTIONS = Hook("deepspeed.runtime.pipe.engine:PipelineEngine", "_INSTRUCTION_MAP", _PP, _PP_INSTEAD)
PIPE_OPTIMIZER_STEP = Hook("deepspeed.runtime.pipe.schedule", "OptimizerStep", _PP, _PP_INSTEAD)
_COMMS, _COMMS_INSTEAD = "the communication log (--comms_log)", "train without --comms_log"
COMMS_LOGGER = Hook("deepspeed.comm.comm", "comms_logger", _COMMS, _COMMS_INSTEAD)
COMMS_APPEND = Hook("deepspeed.utils.comms_logging:CommsLogger", "append", _COMMS, _COMMS_INSTEAD)
COMMS_RECORDS = Hook("deepspeed.utils.comms_logging:CommsLogger", "comms_dict", _COMMS, _COMMS_INSTEAD)  # instance
PIPE_P2P_GROUPS = Hook("deepspeed.runtime.pipe.p2p", "_groups", _RELEASE)
PIPE_P2P_GRID = Hook("deepspeed.runtime.pipe.p2p", "_grid", _RELEASE)
PIPE_SPECS = Hook("deepspeed.runtime.pipe.module:PipelineModule", "_layer_specs", _PP, _PP_INSTEAD)  # instance
PIPE_CLIP = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "clip_fp32_gradients", _PP, _PP_INSTEAD)
_SAVE = "checksums and full-disk handling of checkpoint saves"
CHECKPOINT_WRITE = Hook("deepspeed.runtime.checkpoint_engine.checkpoint_engine:CheckpointEngine", "save", _SAVE)
RECOVERY_SCRIPT = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "_copy_recovery_script", _SAVE)

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
    SHM_BUILD,
    COMM_BACKEND,
    BACKEND_ALL_REDUCE,
    UNIVERSAL_CONVERTER,
    UNIVERSAL_VERSION,
    TP_GROUPS,
    TP_GATHER,
    PIPE_INSTRUCTIONS,
    PIPE_OPTIMIZER_STEP,
    PIPE_CLIP,
    PIPE_P2P_GROUPS,
    PIPE_P2P_GRID,
    COMMS_LOGGER,
    COMMS_APPEND,
    CHECKPOINT_WRITE,
    RECOVERY_SCRIPT,
)


def check_hooks() -> list[str]:
    """Resolve every hook against the installed DeepSpeed and torch, without an engine; the names checked."""
    for hook in HOOKS:
        hook.resolve()
    return [hook.where for hook in HOOKS]


class NonFiniteSkipBroken(RuntimeError):
    """The non-finite skip's hook did not skip an update (see SkipSwitch.confirm_skipped)."""


class SkipSwitch:
    """Makes the next engine.step() at an accumulation boundary skip its update, through DeepSpeed's overflow path.

    ZeRO-1/2 (DeepSpeedZeroOptimizer) and ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) both discard a step when their
    `overflow` flag is set: gradients cleared, loss scale updated, and the engine skips the LR scheduler and counts
    the step in `skipped_steps`. The switch sets that flag where each optimizer computes it. A plain torch optimizer
    (ZeRO stage 0, fp32) has its step replaced by a zero_grad. Any other optimizer is refused.
    """

    def __init__(self, optimizer):
        self.skip = False
        self.fired = 0  # how often a hook acted on `skip` since the last confirm_skipped
        # A plain torch optimizer first: a stage-0 run needs none of the ZeRO internals.
        if type(optimizer).__module__.startswith("torch.optim"):
            self._hook_torch(optimizer)
        elif isinstance(optimizer, STAGE3_CHECK.owner_object()):
            self._hook_stage3(optimizer)
        elif isinstance(optimizer, STAGE12_CHECK.owner_object()):
            self._hook_stage12(optimizer)
        else:
            raise RuntimeError(
                f"--on_nonfinite skip: cannot skip updates of a {type(optimizer).__name__} optimizer "
                "(use ZeRO stage 1-3, or --on_nonfinite stop)"
            )

    def confirm_skipped(self, engine) -> None:
        """After a step the switch was to skip: its hook ran and DeepSpeed did not apply the update. A DeepSpeed that
        no longer calls the hooked method, or that ignores the overflow flag, stops the run here instead of silently
        applying the updates the non-finite policy rejected."""
        fired, self.fired = self.fired, 0
        if fired and not engine.was_step_applied():
            return
        import deepspeed

        raise NonFiniteSkipBroken(
            f"--on_nonfinite skip: a step to be skipped was {'applied' if fired else 'not intercepted'} (the hook "
            f"{'ran' if fired else 'never ran'}): DeepSpeed {deepspeed.__version__} handles updates differently from "
            f"the versions this hook was checked with ({', '.join(CHECKED_DEEPSPEED_VERSIONS)}); use --on_nonfinite "
            "stop or a checked DeepSpeed"
        )

    def _hook_stage3(self, optimizer) -> None:
        # Every hook is resolved before any is installed: a moved one leaves the optimizer untouched.
        original = STAGE3_CHECK.on(optimizer)
        cleanup = STAGE3_CLEANUP.on(optimizer)
        OVERFLOW.on(optimizer)

        def check_stage3(update_scale=True):
            if not self.skip:
                return original(update_scale)
            self.fired += 1
            optimizer.overflow = True
            return cleanup() if update_scale else True

        optimizer._overflow_check_and_loss_scale_update = check_stage3

    def _hook_stage12(self, optimizer) -> None:
        original_check = STAGE12_CHECK.on(optimizer)
        checked = STAGE12_CHECKED.on(optimizer)
        OVERFLOW.on(optimizer)

        def check_stage12(partition_gradients=True):
            if self.skip:
                self.fired += 1
                optimizer.overflow = True
            elif checked:
                original_check(partition_gradients=partition_gradients)

        optimizer.check_overflow = check_stage12
        # Now consulted on every step; a non-finite gradient norm also counts as overflow under bf16.
        optimizer.check_grad_overflow = True

    def _hook_torch(self, optimizer) -> None:
        original_step = optimizer.step
        optimizer.overflow = False

        def step(*args, **kwargs):
            optimizer.overflow = self.skip
            if self.skip:
                self.fired += 1
                optimizer.zero_grad(set_to_none=True)
                return None
            return original_step(*args, **kwargs)

        optimizer.step = step


def release_zero3_references(module) -> None:
    """Drop the module-level references a destroyed ZeRO-3 engine leaves behind (DeepSpeed 0.19,
    deepspeed/runtime/zero): its modules on the global forward-module stack, and a class-wide `functools.lru_cache`
    on PartitionedParameterCoordinator.__params_to_release, keyed by coordinator and module."""
    stack = FWD_MODULE_STACK.resolve()
    PARAMS_TO_RELEASE.resolve()  # the cache we know of must still be there
    coordinator = PARAMS_TO_RELEASE.owner_object()
    own = {id(sub) for sub in module.modules()}  # a forward cut short leaves submodules there too
    stack[:] = [sub for sub in stack if id(sub) not in own]
    for attribute in vars(coordinator).values():
        for cache in _caches(attribute):
            cache.cache_clear()


def release_pipeline_references() -> None:
    """Drop the module-level references of DeepSpeed's pipeline point-to-point layer (deepspeed/runtime/pipe/p2p.py
    keeps the grid and one process group per pair of adjacent stages in globals, alive after the engine is gone)."""
    PIPE_P2P_GROUPS.resolve()
    PIPE_P2P_GRID.resolve()
    from deepspeed.runtime.pipe import p2p

    p2p._groups = None
    p2p._grid = None


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


def skip_shm_op_build() -> None:
    """Replace DeepSpeed's shm all-reduce build by a no-op: a single CPU rank never communicates, and the build
    takes tens of seconds to minutes on a fresh machine."""
    # importlib (in Hook): `import deepspeed.comm.torch` would resolve to the torch package re-exported there.
    SHM_BUILD.resolve()
    SHM_BUILD.owner_object().build_shm_op = lambda: None


class ShmAllReduce:
    """Large synchronous all-reduce sums over every rank, sent through DeepSpeed's shared-memory kernel instead of
    the backend's (gloo) all_reduce; everything else (other groups, other ops, async calls, small or strided tensors,
    types the host's kernel cannot sum) goes to the original. Installed on DeepSpeed's backend instance after
    deepspeed.init_distributed, so the comms logger still sees each call as an all_reduce.

    Every rank routes a call the same way: the tests below depend only on what all ranks of an all-reduce share
    (its group, op, dtype and size), so a call never meets gloo on one rank and shared memory on another."""

    def __init__(self, world_size: int, min_bytes: int):
        import torch

        self.world_size, self.min_bytes = world_size, min_bytes
        self.calls, self.bytes = 0, 0
        backend = COMM_BACKEND.resolve()
        if backend is None:
            raise RuntimeError("ShmAllReduce: deepspeed.init_distributed has not run")
        self._original = BACKEND_ALL_REDUCE.on(backend)
        # Both set on the instance; the level only where DeepSpeed built and loaded the kernel.
        level = SHM_KERNEL_LEVEL.on(backend) if SHM_COMM_OP.on(backend) is not None else 0
        self._kernel = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)
        # The kernel's fp32 sums need AVX2 (level 1), its bf16/fp16 ones AVX-512BW (level 2).
        self.dtypes = (
            {torch.float32} if level == 1 else {torch.float32, torch.bfloat16, torch.float16} if level >= 2 else set()
        )
        self.usable = self._kernel is not None and bool(self.dtypes)
        self._backend = backend

    def install(self) -> None:
        import torch

        route = self.routes
        kernel, original = self._kernel, self._original

        @torch.compiler.disable
        def all_reduce(tensor, op=None, group=None, async_op=False):
            if route(tensor, op, group, async_op):
                kernel(tensor)
                return None
            return original(
                tensor=tensor, op=torch.distributed.ReduceOp.SUM if op is None else op, group=group, async_op=async_op
            )

        self._backend.all_reduce = all_reduce

    def uninstall(self) -> None:
        self._backend.__dict__.pop("all_reduce", None)

    def routes(self, tensor, op, group, async_op) -> bool:
        """Whether this all-reduce goes through shared memory (and counts it)."""
        import torch.distributed as tdist

        nbytes = tensor.numel() * tensor.element_size()
        if (
            async_op
            or nbytes < self.min_bytes
            or tensor.dtype not in self.dtypes
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or not _is_sum(op)
        ):
            return False
        if (
            group is not None
            and group is not tdist.GroupMember.WORLD
            and tdist.get_world_size(group) != self.world_size
        ):
            return False
        self.calls += 1
        self.bytes += nbytes
        return True


def _is_sum(op) -> bool:
    """DeepSpeed's ReduceOp.SUM (an Enum), torch's (a pybind enum: also named), or the default (None)."""
    return op is None or getattr(op, "name", None) == "SUM"


def universal_checkpoint_info(tensor_parallel_size: int = 1) -> dict:
    """The client-state entry that lets ds_to_universal convert a checkpoint for another rank count. Under tensor
    parallelism AutoTP records its own (how each parameter is split), and the client state would overwrite it: then
    ds_to_universal merges the shards wrongly without an error. So none is added there."""
    if tensor_parallel_size > 1:
        return {}
    return {"universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION}}


@dataclass
class CheckpointWrites:
    """What one rank wrote during engine.save_checkpoint: the files, and the first write that failed (or None)."""

    paths: list = field(default_factory=list)
    failed: tuple | None = None  # (path, exception)


@contextmanager
def recorded_checkpoint_writes(engine, is_write_failure: Callable[[BaseException], bool]) -> Iterator[CheckpointWrites]:
    """Record this rank's checkpoint files while DeepSpeed saves. A write failure (`is_write_failure`: a full disk)
    is kept instead of raised, and later writes are skipped: raising would leave this rank out of the barriers that
    DeepSpeed's save_checkpoint runs after the writes, with the other ranks waiting in them for ever."""
    writes = CheckpointWrites()
    checkpoint_engine = engine.checkpoint_engine
    write = CHECKPOINT_WRITE.on(checkpoint_engine)
    copy_script = RECOVERY_SCRIPT.on(engine)

    def guarded(action: Callable[..., Any], where: str, *args: Any, **kwargs: Any) -> bool:
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


def tensor_parallel_mpu(tensor_parallel_size: int):
    """AutoTP's tensor- and data-parallel groups (consecutive ranks per TP group), built before
    deepspeed.initialize; the returned module is the `mpu` that makes the engine count data-parallel ranks."""
    from deepspeed.utils import groups

    TP_GROUPS.on(groups)(tensor_model_parallel_size=tensor_parallel_size)
    return groups


def gathered_state_dict(engine) -> dict:
    """The full weights on rank 0 (every rank must call it: it gathers TP shards, and ZeRO-3 partitions)."""
    return TP_GATHER.on(engine)()


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


def before_pipeline_update(engine, callback: Callable[[], None]) -> None:
    """Call `callback()` on every rank right before each pipeline update (the schedule's OptimizerStep, which every
    stage reaches once per train_batch, after its gradients are reduced): a collective there lines up."""
    step_instruction = PIPE_OPTIMIZER_STEP.resolve()
    table = dict(PIPE_INSTRUCTIONS.on(type(engine)))
    update = table[step_instruction]

    def agreed_update(self, *args, **kwargs):
        callback()
        return update(self, *args, **kwargs)

    table[step_instruction] = agreed_update
    engine._INSTRUCTION_MAP = table  # the instance's table: the class's stays DeepSpeed's


def fix_pipeline_stage0_clipping(engine) -> None:
    """ZeRO-0 under pipeline parallelism: clip by the norm of every stage's gradients (see the module docstring).

    Each parameter counts once: a tied weight (held by the first and last stage, its gradient all-reduced between
    them) only on the lowest rank of its tie group. The norm is summed over the pipe group (the data-parallel
    replicas hold equal, already averaged gradients) and kept as the engine's global gradient norm."""
    import torch
    import torch.distributed as torch_dist

    PIPE_CLIP.on(engine)
    module, grid = engine.module, engine.grid
    tied_elsewhere = set()
    for comm in getattr(module, "tied_comms", {}).values():
        if engine.global_rank != min(comm["ranks"]):
            tied_elsewhere.update(id(p) for p in comm["module"].parameters())
    counted = [p for p in module.parameters() if id(p) not in tied_elsewhere]
    max_norm = engine.gradient_clipping()

    def clip_over_every_stage():
        squares = torch.zeros(1, dtype=torch.float64, device=engine.device)
        for param in counted:
            if param.grad is not None:
                squares += param.grad.detach().double().pow(2).sum()
        torch_dist.all_reduce(squares, group=grid.get_pipe_parallel_group())
        norm = float(squares.sqrt())
        factor = max_norm / (norm + 1e-6)
        if factor < 1.0:
            for param in module.parameters():
                if param.grad is not None:
                    param.grad.detach().mul_(factor)
        engine._global_grad_norm = norm
        return norm

    engine.clip_fp32_gradients = clip_over_every_stage


def release_other_stages(module) -> None:
    """Drop the PipelineModule's references to the layers of other stages (their LayerSpecs hold the Hugging Face
    modules they wrap), so each rank keeps only its own stage's weights once the full model it built is gone."""
    specs = PIPE_SPECS.on(module)
    start, stop = require(module, "_local_start", _PP, _PP_INSTEAD), require(module, "_local_stop", _PP, _PP_INSTEAD)
    for index, spec in enumerate(specs):
        if not start <= index < stop and hasattr(spec, "module_args"):
            spec.module_args, spec.module_kwargs = (), {}


def per_op_comm_latencies(bandwidth: Callable[[str, int, float], tuple]):
    """DeepSpeed's comms logger, made to record each op's own latency (see the module docstring) with
    `bandwidth(op, bytes, ms) -> (algbw, busbw)`; its records keep DeepSpeed's format,
    {name: {bytes: [count, [ms], [algbw], [busbw]]}}."""
    logger = COMMS_LOGGER.resolve()
    COMMS_APPEND.on(logger)
    records = COMMS_RECORDS.on(logger)
    running = {}  # the last running total per op name

    def append(raw_name, record_name, latency, msg_size):
        own = latency - running.get(record_name, 0.0)
        if own < -1e-6:
            raise moved(
                COMMS_APPEND.where,
                "received a latency below the previous one of the same op, so no longer a running total",
                _COMMS,
                _COMMS_INSTEAD,
            )
        running[record_name] = latency
        algbw, busbw = bandwidth(raw_name, msg_size, own)
        entry = records.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
        entry[0] += 1
        entry[1].append(own)
        entry[2].append(algbw)
        entry[3].append(busbw)

    logger.append = append
    return logger
