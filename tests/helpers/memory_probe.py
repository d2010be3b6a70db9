"""Test helper: train through the real pipeline phases and measure this rank's model-state memory just before each
optimizer update (the peak of model states: weights, reduced gradients, optimizer states and ZeRO's flat buffers
and partitions; the backward has freed the activations): the bytes of every distinct tensor storage alive in the
process. Writes memory_rank<R>.json (a list, one figure per step) into --output_dir.

Under pipeline parallelism the pipe engine never calls engine.step: the figure is taken right before its update
instruction (engine.before_pipeline_update, where the run's own step-boundary agreement runs too).

Launched like train.py (deepspeed / torchrun / python) with train.py's flags.
"""

import gc
import json
import sys
from pathlib import Path

import torch


from tests.helpers.phases import trained_run


def live_tensor_bytes(module=None) -> int:
    """Bytes of every distinct tensor storage reachable from Python, and of `module`'s parameter gradients (autograd
    creates a .grad in C++: it has no Python object, so the garbage collector's list misses it until read)."""
    gc.collect()
    seen, total = set(), 0
    grads = [p.grad for p in module.parameters() if p.grad is not None] if module is not None else []
    for obj in [*gc.get_objects(), *grads]:
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - objects that merely look like tensors
            continue
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def main() -> None:
    before_update, before_reduce, accumulating = [], [], []

    def measure(engine):
        from deepspeed.runtime.pipe.engine import PipelineEngine

        if isinstance(engine, PipelineEngine):  # one update per train_batch, and no engine.step
            from scaletrain.engine import before_pipeline_update

            before_pipeline_update(engine, lambda: before_update.append(live_tensor_bytes(engine.module)))
        original_step = engine.step

        def step(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                before_update.append(live_tensor_bytes(engine.module))  # reduced gradients, optimizer states
            else:  # inside the accumulation: the gradients held between micro-batches
                accumulating.append(live_tensor_bytes(engine.module))
            return original_step(*args, **kwargs)

        engine.step = step
        reduce = getattr(engine.optimizer, "reduce_gradients", None)
        if reduce is not None:  # ZeRO-1/2: the end of backward, before gradients are reduced into partitions

            def reduce_gradients(*args, **kwargs):
                before_reduce.append(live_tensor_bytes(engine.module))
                return reduce(*args, **kwargs)

            engine.optimizer.reduce_gradients = reduce_gradients

    with trained_run(sys.argv[1:], finish=False, before_train=measure) as run:
        record = {
            "before_update": before_update,
            "before_reduce": before_reduce,
            "accumulating": accumulating,
            "after_training": live_tensor_bytes(),
        }
        (Path(run.cfg.run.output_dir) / f"memory_rank{run.dist.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
