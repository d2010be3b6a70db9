"""Test helper: train through the real pipeline phases and measure this rank's peak tensor memory during a training
step, as torch.cuda.max_memory_allocated would on a GPU. The CPU has no allocator statistics; torch's profiler
reports every CPU allocation and free with its size (profile_memory=True) while it is on, so it is on from before the
model is built to the end of training, and the peak of a step is the live bytes at the end of the step before it
(every distinct tensor storage, as memory_probe.py counts them) plus the highest running sum of the allocations and
frees within the step. The running sum's change over the step is checked against the change of the live bytes
(`drift`: what the profiler missed or a tensor held only by C++ hid from the count).

Writes peak_memory_rank<R>.json into --output_dir: {"steps": [{"peak", "start", "end", "drift"}, ...]}, one
record per optimizer update after the first (the first builds Adam's moments). Launched like train.py (deepspeed /
torchrun / python) with train.py's flags.
"""

import json
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile


from tests.helpers.memory_probe import live_tensor_bytes
from tests.helpers.phases import trained_run


def step_records(events: list[tuple[int, int]], marks: list[tuple[int, int]]) -> list[dict]:
    """Each step between two marks (time_ns, live bytes at the end of an update): its peak, its live bytes at both
    ends, and the drift between the profiler's running sum and the live bytes over it. `events`: (time_ns, signed
    bytes) of every allocation and free, in time order."""
    records, index, running = [], 0, 0
    for (start_ns, start_live), (end_ns, end_live) in zip(marks, marks[1:], strict=False):
        while index < len(events) and events[index][0] <= start_ns:
            running += events[index][1]
            index += 1
        base, highest = running, running
        while index < len(events) and events[index][0] <= end_ns:
            running += events[index][1]
            highest = max(highest, running)
            index += 1
        records.append(
            {
                "peak": start_live + highest - base,
                "start": start_live,
                "end": end_live,
                "drift": (running - base) - (end_live - start_live),
            }
        )
    return records


def main() -> None:
    marks = []

    def mark(engine):
        live = live_tensor_bytes(engine.module)  # collects garbage first: its frees fall inside the step that made it
        marks.append((time.time_ns(), live))

    def hook(engine):
        from deepspeed.runtime.pipe.engine import PipelineEngine

        name = "train_batch" if isinstance(engine, PipelineEngine) else "step"
        original = getattr(engine, name)

        def wrapped(*args, **kwargs):
            boundary = name == "train_batch" or engine.is_gradient_accumulation_boundary()
            result = original(*args, **kwargs)
            if boundary:
                mark(engine)
            return result

        setattr(engine, name, wrapped)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with trained_run(sys.argv[1:], finish=False, before_train=hook) as run:
            pass
    output_dir, rank = Path(run.cfg.run.output_dir), run.dist.rank
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    (output_dir / f"peak_memory_rank{rank}.json").write_text(json.dumps({"steps": step_records(events, marks)}))


if __name__ == "__main__":
    main()
