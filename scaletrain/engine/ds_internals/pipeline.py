"""DeepSpeed's pipeline engine: the step-boundary agreement run right before each update (the schedule's
OptimizerStep), ZeRO-0's gradient clipping fixed to use every stage's norm, other stages' layers released, and a stage
given its weights as it is built."""

from __future__ import annotations

from collections.abc import Callable

from scaletrain.engine.ds_internals.guard import Hook, require

_PP, _PP_INSTEAD = "pipeline parallelism (--pipeline_parallel_size)", "train without --pipeline_parallel_size"
# The update hook and the clipping fix: proven by tests/distributed/test_pipeline_parallel.py (ZeRO-0 against one
# rank, gradient clipping acting).
PIPE_INSTRUCTIONS = Hook("deepspeed.runtime.pipe.engine:PipelineEngine", "_INSTRUCTION_MAP", _PP, _PP_INSTEAD)
PIPE_OPTIMIZER_STEP = Hook("deepspeed.runtime.pipe.schedule", "OptimizerStep", _PP, _PP_INSTEAD)
PIPE_CLIP = Hook("deepspeed.runtime.engine:DeepSpeedEngine", "clip_fp32_gradients", _PP, _PP_INSTEAD)
# The schedule's instructions a stage waits in for a neighbour stage (a blocking receive: the bubble, and the
# transfer) and those it computes in, timed for the measured bubble: proven by
# tests/distributed/test_pipeline_parallel.py.
_SCHEDULE = "deepspeed.runtime.pipe.schedule"
PIPE_WAITS = tuple(Hook(_SCHEDULE, name, _PP, _PP_INSTEAD) for name in ("RecvActivation", "RecvGrad"))
PIPE_WORK = tuple(Hook(_SCHEDULE, name, _PP, _PP_INSTEAD) for name in ("ForwardPass", "BackwardPass"))
# The stage's own layers, released and built: proven by tests/model/test_stage_build.py. PipelineModule.__init__
# partitions the layers, calls _build() (this rank's layers only), then moves them to the device: a stage built from
# meta-device modules gets its weights between the two.
PIPE_SPECS = Hook("deepspeed.runtime.pipe.module:PipelineModule", "_layer_specs", _PP, _PP_INSTEAD)  # instance
PIPE_BUILD = Hook("deepspeed.runtime.pipe.module:PipelineModule", "_build", _PP, _PP_INSTEAD)


def pipeline_module_class(after_build: Callable | None = None) -> type:
    """DeepSpeed's PipelineModule, or (with `after_build`) a subclass that calls `after_build(module)` right after
    DeepSpeed has built this rank's layers and before it moves them to the device: the one moment this rank's
    stage exists alone, so meta-device layers can be given their weights there."""
    pipeline_module = PIPE_BUILD.owner_object()
    PIPE_BUILD.resolve()
    if after_build is None:
        return pipeline_module

    class StagePipelineModule(pipeline_module):  # type: ignore[misc, valid-type]  # found at run time
        def _build(self):
            super()._build()
            after_build(self)

    return StagePipelineModule


def _wrap_instruction(engine, instruction_type, wrap: Callable) -> None:
    """Replace the handler of one schedule instruction by `wrap(handler)` in the engine's own instruction table (a
    copy of the class's the first time, so the class's stays DeepSpeed's; wrappers added to one engine chain)."""
    table = dict(PIPE_INSTRUCTIONS.on(engine))
    table[instruction_type] = wrap(table[instruction_type])
    engine._INSTRUCTION_MAP = table


def before_pipeline_update(engine, callback: Callable[[], None]) -> None:
    """Call `callback()` on every rank right before each pipeline update (the schedule's OptimizerStep, which every
    stage reaches once per train_batch, after its gradients are reduced): a collective there lines up. Callbacks
    added to one engine chain (the last added runs first)."""

    def agreed(update):
        def agreed_update(self, *args, **kwargs):
            callback()
            return update(self, *args, **kwargs)

        return agreed_update

    _wrap_instruction(engine, PIPE_OPTIMIZER_STEP.resolve(), agreed)


class InstructionTimes:
    """Seconds this stage spent, while `active`, in the pipe schedule's receives (waiting for a neighbour stage) and
    in its forward and backward passes."""

    def __init__(self):
        self.active = False
        self.idle = self.busy = 0.0

    def take(self) -> tuple:
        """(idle, busy) seconds since the last take."""
        taken = self.idle, self.busy
        self.idle = self.busy = 0.0
        return taken


def time_pipeline_instructions(engine) -> InstructionTimes:
    """Time the engine's receive, forward and backward instructions (in its own instruction table): what the
    measured bubble is made of."""
    import time

    times = InstructionTimes()

    def timed(kind: str):
        def wrap(handler):
            def instruction(self, *args, **kwargs):
                if not times.active:
                    return handler(self, *args, **kwargs)
                started = time.perf_counter()
                try:
                    return handler(self, *args, **kwargs)
                finally:
                    setattr(times, kind, getattr(times, kind) + time.perf_counter() - started)

            return instruction

        return wrap

    for hooks, kind in ((PIPE_WAITS, "idle"), (PIPE_WORK, "busy")):
        for hook in hooks:
            _wrap_instruction(engine, hook.resolve(), timed(kind))
    return times


def fix_pipeline_stage0_clipping(engine) -> None:
    """ZeRO-0 under pipeline parallelism: clip by the norm of every stage's gradients. DeepSpeed 0.19.8 computes the
    clipping norm with the pipe grid as `mpu`, whose "model parallel rank" is the stage, so only stage 0's gradients
    enter the norm and every stage clips by it.

    Each parameter counts once: a tied weight (held by the first and last stage, its gradient all-reduced between
    them) only on the lowest rank of its tie group, and under tensor parallelism a weight every tensor rank holds
    whole only on tensor rank 0 (a split one, marked tensor_model_parallel by AutoTP, on each). The norm is summed
    over the grid's model-parallel group (the stages x their tensor ranks: the data-parallel replicas hold equal,
    already averaged gradients) and kept as the engine's global gradient norm."""
    import torch
    import torch.distributed as torch_dist

    PIPE_CLIP.on(engine)
    module, grid = engine.module, engine.grid
    tied_elsewhere: set[int] = set()  # id() of each parameter counted on another rank of its tie group
    for comm in getattr(module, "tied_comms", {}).values():
        if engine.global_rank != min(comm["ranks"]):
            tied_elsewhere.update(id(p) for p in comm["module"].parameters())
    first_tensor_rank = grid.get_slice_parallel_rank() == 0
    counted = [
        p
        for p in module.parameters()
        if id(p) not in tied_elsewhere and (first_tensor_rank or getattr(p, "tensor_model_parallel", False))
    ]
    max_norm = engine.gradient_clipping()

    def clip_over_every_stage():
        squares = torch.zeros(1, dtype=torch.float64, device=engine.device)
        for param in counted:
            if param.grad is not None:
                squares += param.grad.detach().double().pow(2).sum()
        torch_dist.all_reduce(squares, group=grid.get_model_parallel_group())
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
