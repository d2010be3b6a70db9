"""The one place scaletrain touches DeepSpeed (and torch) internals: private names, module globals, class caches.

One module per DeepSpeed area, under the version guard in guard.py (checked versions, Hook, the once-per-process
version warning, DeepSpeedInternalsMoved): optimizer.py (the ZeRO optimizers' overflow path: the non-finite skip),
release.py (references left after engine.destroy()), op_builds.py (op builders and torch's build directory), comm.py
(the shm all-reduce and the comms logger), checkpoints.py (universal checkpoints, the record of a save's writes),
tensor_parallel.py (AutoTP's groups and gather), pipeline.py (the pipeline engine's update, clipping and layers),
and checklist.py (HOOKS, check_hooks). This package re-exports their public names.

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
- cpuinfo.get_cpu_info (py-cpuinfo, which DeepSpeed's CPU op builders and DeepSpeedCPUAdam call, a fresh interpreter
  probing the CPU each time, three times per rank to load cpu_adam): answered once per host boot, kept in the ops'
  build folder (remember_cpu_info). tests/test_ops.py::test_the_cpu_probe_runs_once_per_host_boot.
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
  modules they wrap; they are emptied so those modules are freed. PipelineModule._build (called by its __init__
  between partitioning and the move to the device): a subclass gives a stage built from meta-device modules its
  weights there, read from the safetensors files. tests/test_stage_build.py.
- deepspeed.comm.comm.comms_logger, CommsLogger.append and .comms_dict: DeepSpeed 0.19.8 hands append the running
  total of every op of a name so far (timed_op reads its timer with reset=False) as the op's latency; --comms_log
  replaces the instance's append with one that keeps each op's own time (and refuses a total that shrinks: a
  fixed DeepSpeed). tests/test_comm_log.py (per-op latencies against wall-clock times of known collectives, and
  that DeepSpeed's own figures are still running totals).
- deepspeed.comm.comm.get_msg_size_from_args: the logger is not told an op's group, so --comms_log wraps this module
  global (timed_op calls it with the op and its arguments just before the op) to note the group's size, for each
  op's bus bandwidth. tests/test_comm_log.py (an all-reduce on a one-rank group has no bus traffic).
- engine.checkpoint_engine.save (every shard DeepSpeed writes, on an instance) and
  DeepSpeedEngine._copy_recovery_script (rank 0's copy of zero_to_fp32.py): recorded_checkpoint_writes keeps each
  rank's list of written files (checksummed into commit.json) and turns a failed write (a full disk) into a recorded
  error instead of a raise, so that the failing rank still reaches DeepSpeed's barriers inside save_checkpoint with
  the others. tests/test_checkpoint_integrity.py (a disk filled during a save, at 2 ranks).

Importing this package (or any of its modules) imports neither torch nor DeepSpeed; each function imports what it
touches.
"""

from __future__ import annotations

from scaletrain.engine.ds_internals.checklist import (
    check_deepspeed_hooks,
    HOOKS,
    check_hooks,
)
from scaletrain.engine.ds_internals.checkpoints import (
    CHECKPOINT_WRITE,
    CheckpointWrites,
    RECOVERY_SCRIPT,
    UNIVERSAL_CHECKPOINT_VERSION,
    UNIVERSAL_CONVERTER,
    UNIVERSAL_VERSION,
    recorded_checkpoint_writes,
    separate_step_counters,
    universal_checkpoint_info,
    universal_conversion_command,
)
from scaletrain.engine.ds_internals.config_models import CONFIG_MODELS, deepspeed_config_models
from scaletrain.engine.ds_internals.comm import (
    BACKEND_ALL_REDUCE,
    COMMS_APPEND,
    COMMS_LOGGER,
    COMMS_MSG_SIZE,
    COMMS_RECORDS,
    COMM_BACKEND,
    SHM_BUILD,
    SHM_COMM_OP,
    SHM_KERNEL_LEVEL,
    ShmAllReduce,
    per_op_comm_latencies,
    skip_shm_op_build,
)
from scaletrain.engine.ds_internals.guard import (
    CHECKED_DEEPSPEED_VERSIONS,
    CHECKED_TORCH_VERSIONS,
    DeepSpeedInternalsMoved,
    Hook,
    check_version,
    moved,
    require,
)
from scaletrain.engine.ds_internals.op_builds import (
    BUILDER_COMPATIBLE,
    BUILDER_LOAD,
    BUILDER_NAME,
    BUILD_DIRECTORY,
    CPU_INFO,
    CREATE_OP_BUILDER,
    INSTALLED_OPS,
    create_op_builder,
    op_preinstalled,
    remember_cpu_info,
    torch_build_directory,
)
from scaletrain.engine.ds_internals.optimizer import (
    NonFiniteSkipBroken,
    OVERFLOW,
    STAGE12_CHECK,
    STAGE12_CHECKED,
    STAGE12_INIT,
    STAGE3_CHECK,
    STAGE3_CLEANUP,
    SkipSwitch,
)
from scaletrain.engine.ds_internals.pipeline import (
    PIPE_BUILD,
    PIPE_CLIP,
    PIPE_INSTRUCTIONS,
    PIPE_OPTIMIZER_STEP,
    PIPE_SPECS,
    before_pipeline_update,
    fix_pipeline_stage0_clipping,
    pipeline_module_class,
    release_other_stages,
)
from scaletrain.engine.ds_internals.release import (
    FWD_MODULE_STACK,
    PARAMS_TO_RELEASE,
    PIPE_P2P_GRID,
    PIPE_P2P_GROUPS,
    release_pipeline_references,
    release_zero3_references,
)
from scaletrain.engine.ds_internals.tensor_parallel import (
    TP_GATHER,
    TP_GROUPS,
    gathered_state_dict,
    tensor_parallel_mpu,
)

__all__ = [
    "BACKEND_ALL_REDUCE",
    "BUILDER_COMPATIBLE",
    "BUILDER_LOAD",
    "BUILDER_NAME",
    "BUILD_DIRECTORY",
    "CHECKED_DEEPSPEED_VERSIONS",
    "CHECKED_TORCH_VERSIONS",
    "CHECKPOINT_WRITE",
    "COMMS_APPEND",
    "COMMS_LOGGER",
    "COMMS_MSG_SIZE",
    "COMMS_RECORDS",
    "COMM_BACKEND",
    "CPU_INFO",
    "CREATE_OP_BUILDER",
    "CheckpointWrites",
    "DeepSpeedInternalsMoved",
    "FWD_MODULE_STACK",
    "HOOKS",
    "Hook",
    "INSTALLED_OPS",
    "NonFiniteSkipBroken",
    "OVERFLOW",
    "PARAMS_TO_RELEASE",
    "PIPE_BUILD",
    "PIPE_CLIP",
    "PIPE_INSTRUCTIONS",
    "PIPE_OPTIMIZER_STEP",
    "PIPE_P2P_GRID",
    "PIPE_P2P_GROUPS",
    "PIPE_SPECS",
    "RECOVERY_SCRIPT",
    "SHM_BUILD",
    "SHM_COMM_OP",
    "SHM_KERNEL_LEVEL",
    "STAGE12_CHECK",
    "STAGE12_CHECKED",
    "STAGE12_INIT",
    "STAGE3_CHECK",
    "STAGE3_CLEANUP",
    "ShmAllReduce",
    "SkipSwitch",
    "TP_GATHER",
    "TP_GROUPS",
    "UNIVERSAL_CHECKPOINT_VERSION",
    "UNIVERSAL_CONVERTER",
    "UNIVERSAL_VERSION",
    "before_pipeline_update",
    "check_deepspeed_hooks",
    "check_hooks",
    "CONFIG_MODELS",
    "deepspeed_config_models",
    "check_version",
    "create_op_builder",
    "fix_pipeline_stage0_clipping",
    "gathered_state_dict",
    "moved",
    "op_preinstalled",
    "per_op_comm_latencies",
    "recorded_checkpoint_writes",
    "remember_cpu_info",
    "pipeline_module_class",
    "release_other_stages",
    "release_pipeline_references",
    "release_zero3_references",
    "require",
    "skip_shm_op_build",
    "tensor_parallel_mpu",
    "torch_build_directory",
    "separate_step_counters",
    "universal_checkpoint_info",
    "universal_conversion_command",
]
