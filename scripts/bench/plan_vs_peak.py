"""--plan's per-GPU total (model states + working memory, without or with activation checkpointing as the run) against
each rank's measured peak during a training step, for single and composed layouts: the tiny Llama in fp32,
micro-batch 4 of 64 tokens, 3 steps, the peak of the last; each pipeline stage against its own plan.

Each run is tests/helpers/peak_memory_probe.py (train.py's phases under torch's profiler with profile_memory=True
from before the model is built: the live tensor bytes at the end of step 2 plus the highest running sum of step 3's
allocations and frees). `drift` is how far the running sum ends from the live bytes counted at the end of step 3
(what the measure missed); `start` is the live bytes at the step's start (weights, optimizer states and what ZeRO
keeps between steps).

    python scripts/bench/plan_vs_peak.py
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from scripts.bench.common import bench_parser, launch

REPO = Path(__file__).resolve().parents[2]

PROBE = "tests/helpers/peak_memory_probe.py"

# (ZeRO stage, gradient accumulation, TP, SP, PP, DP, activation checkpointing)
LAYOUTS = (
    (2, 1, 1, 1, 1, 1, False),
    (2, 2, 1, 1, 1, 1, False),
    (1, 2, 1, 1, 1, 1, False),
    (1, 1, 1, 1, 1, 2, False),
    (1, 1, 2, 1, 1, 1, False),
    (2, 1, 2, 1, 1, 1, False),
    (2, 1, 1, 2, 1, 1, False),
    (3, 1, 1, 2, 1, 1, False),
    (3, 1, 2, 1, 1, 2, False),
    (2, 1, 2, 2, 1, 1, False),
    (1, 2, 1, 1, 2, 1, False),
    (1, 2, 2, 1, 2, 1, False),
    (1, 2, 2, 1, 2, 2, False),
    (2, 1, 2, 2, 1, 2, False),
    (2, 1, 1, 1, 1, 1, True),
    (3, 1, 1, 2, 1, 1, True),
    (1, 2, 2, 1, 2, 1, True),
)


def planned(run_dir: Path, layout: tuple, micro: int, block: int, rank: int) -> tuple:
    """(model states, planned peak) bytes the planner gives `rank` (its pipeline stage's) for this run's resolved
    DeepSpeed config; `layout` as in LAYOUTS."""
    stage, accumulation, tp, sp, pp, dp, checkpointing = layout
    from scaletrain.observability import memory_planner
    from scaletrain.parts import ParallelLayout

    shape = tiny_shape()
    bucket = json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["reduce_bucket_size"]
    parallel = ParallelLayout(tp=tp, sp=sp, pp=pp, dp=dp)
    run = memory_planner.PlannedRun(
        gpus_per_node=parallel.world_size, parallel=parallel, micro_batch=micro, block_size=block, precision="fp32",
        loss_chunk=memory_planner.auto_loss_chunk(shape.vocab), grad_accum=accumulation,
    )  # fmt: skip
    option = next(o for o in memory_planner.OPTIONS if o.stage == stage and o.offload_optimizer == "none")
    which = "first" if pp > 1 and rank < tp * sp * dp else "last"  # the pipe axis varies slowest
    stage_shape = shape.pipeline_stage(pp, which)
    states = sum(
        memory_planner.model_state_bytes(
            option, shape=stage_shape, dp=dp * sp, precision="fp32", tp=tp, pp=1, reduce_bucket=bucket
        )[:3]
    )
    return states, memory_planner.peak_bytes(shape, run, option, bucket, which)[int(checkpointing)]


@functools.cache
def tiny_shape():
    from transformers import AutoConfig

    from scaletrain.model.build import meta_model
    from scaletrain.observability.memory_planner import ModelShape

    config = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")
    return ModelShape.from_meta_model(meta_model(config, False), config)


def main() -> None:
    args = bench_parser(__doc__, block_size=64, batch=4).parse_args()
    mib = 2**20
    print(
        "| layout | ZeRO | rank | measured peak MiB | drift | start | planned states + working = total MiB "
        "| planned / measured |\n|---|---|---|---|---|---|---|---|"
    )
    for layout in LAYOUTS:
        stage, accumulation, tp, sp, pp, dp, checkpointing = layout
        nprocs = tp * sp * pp * dp
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            flags = ["--config", f"ds_configs/zero{stage}.json", "--output_dir", str(run_dir), "--max_steps", "3"]
            flags += ["--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch)]
            flags += ["--gradient_accumulation_steps", str(accumulation), "--disable_tqdm", "--max_eval_samples", "8"]
            flags += ["--tensor_parallel_size", str(tp), "--sequence_parallel_size", str(sp)]
            flags += ["--pipeline_parallel_size", str(pp), "--peak_tflops", "0.2"]
            flags += ["--gradient_checkpointing"] if checkpointing else []
            launch(PROBE, flags, nprocs)
            sizes = [f"{kind} {size}" for kind, size in (("TP", tp), ("SP", sp), ("PP", pp), ("DP", dp)) if size > 1]
            name = " x ".join(sizes) or "1 rank"
            name += f", accumulation {accumulation}" if accumulation > 1 else ""
            name += ", checkpointing" if checkpointing else ""
            for rank in range(nprocs):
                step = json.loads((run_dir / f"peak_memory_rank{rank}.json").read_text())["steps"][-1]
                states, total = planned(run_dir, layout, args.batch, args.block_size, rank)
                working = total - states
                print(
                    f"| {name} | {stage} | {rank} | {step['peak'] / mib:.2f} | {step['drift'] / mib:+.2f} | "
                    f"{step['start'] / mib:.2f} | {states / mib:.2f} + {working / mib:.2f} = {total / mib:.2f} | "
                    f"{total / step['peak']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
