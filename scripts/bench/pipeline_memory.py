"""The memory planner against real pipeline runs: ZeRO-1 under PP 2 and PP 2 x DP 2, the tiny Llama in fp32.

Each run is tests/helpers/memory_probe.py (train.py's phases, every live tensor storage counted right before the pipe
engine's update and before ZeRO's gradient reduction); the figure of a rank is the larger of the two on step 2,
against the planner's model states for the largest stage, plus on the last stage the logits the pipe engine keeps
in its two output buffers. tests/observability/test_memory_planner.py asserts the same within 10%.

    python scripts/bench/pipeline_memory.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from scripts.bench.common import bench_parser, launch

REPO = Path(__file__).resolve().parents[2]

PROBE = "tests/helpers/memory_probe.py"


def planned_bytes(ds_config: Path, dp: int, micro_batch: int, block_size: int) -> tuple:
    """(first stage, last stage) bytes the planner gives for this run's resolved DeepSpeed config."""
    from transformers import AutoConfig

    from scaletrain.model.build import meta_model
    from scaletrain.observability import memory_planner

    config = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")
    shape = memory_planner.ModelShape.from_meta_model(meta_model(config, False), config)
    bucket = json.loads(ds_config.read_text())["zero_optimization"]["reduce_bucket_size"]
    option = next(o for o in memory_planner.OPTIONS if o.stage == 1)
    params, grads, optimizer, _, _ = memory_planner.model_state_bytes(
        option, shape=shape, dp=dp, precision="fp32", pp=2, reduce_bucket=bucket
    )
    states = params + grads + optimizer
    return states, states + memory_planner.pipeline_kept_outputs(
        shape, micro_batch=micro_batch, block_size=block_size, precision="fp32"
    )


def main() -> None:
    parser = bench_parser(__doc__, block_size=64, batch=4)
    args = parser.parse_args()
    print("| layout | rank (stage) | planned MiB | measured MiB | planned - measured |\n|---|---|---|---|---|")
    for nprocs in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            flags = ["--config", "ds_configs/zero1.json", "--output_dir", str(run_dir), "--max_steps", "2"]
            flags += ["--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch)]
            flags += ["--gradient_accumulation_steps", "2", "--pipeline_parallel_size", "2", "--disable_tqdm"]
            flags += ["--max_eval_samples", "8"]
            launch(PROBE, flags, nprocs)
            dp = nprocs // 2
            first, last = planned_bytes(run_dir / "ds_config.json", dp, args.batch, args.block_size)
            for rank in range(nprocs):
                memory = json.loads((run_dir / f"memory_rank{rank}.json").read_text())
                measured = max([memory["before_update"][1], *memory["before_reduce"][1:2]])
                planned = last if rank >= dp else first
                layout = "PP 2" if dp == 1 else f"PP 2 x DP {dp}"
                stage = "last" if rank >= dp else "first"
                print(
                    f"| {layout} | {rank} ({stage}) | {planned / 2**20:.2f} | {measured / 2**20:.2f} | "
                    f"{(planned - measured) / measured * 100:+.1f}% |"
                )


if __name__ == "__main__":
    main()
