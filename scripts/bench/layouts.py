"""Throughput of each parallel layout against pure data parallelism, same model, data, global batch and ranks.

Runs train.py alternately (--rounds times each) at 2 ranks: data parallelism (ZeRO-2, micro-batch B/2 per rank),
tensor parallelism 2 and sequence parallelism 2 (ZeRO-2, both ranks read the same micro-batch of B; under SP each
keeps half of every block's tokens), pipeline parallelism 2 (ZeRO-1, its engine takes no ZeRO-2: 4 micro-batches of
B/4 through the 1F1B schedule), on the same global batch of B blocks,
and reports steady-state tokens/s per rank (tokens between the end of step --warmup and the last step, over the
wall-clock stamps of metrics.jsonl, divided by the ranks).

    python scripts/bench/layouts.py               # prints Markdown rows for BENCHMARKS.md and a JSON line

On a CPU this measures the CPU (gloo, shared-memory all-reduce, 2 cores), not what a GPU node with NVLink does.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench.common import bench_model, bench_parser, median_runs, train_args, train_rate  # noqa: E402

LAYOUTS = {  # name -> (flags, micro-batch as a fraction of the global batch, ZeRO config)
    "data parallel 2": ([], 2, "zero2"),
    "tensor parallel 2": (["--tensor_parallel_size", "2"], 1, "zero2"),
    "sequence parallel 2": (["--sequence_parallel_size", "2"], 1, "zero2"),
    "pipeline parallel 2": (["--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "4"], 4, "zero1"),
}


def main() -> None:
    parser = bench_parser(__doc__, steps=40, warmup=10, rounds=2, block_size=256)
    parser.add_argument("--global_batch", type=int, default=8)
    args = parser.parse_args()

    rates = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp) / "model")
        for round_ in range(args.rounds):
            for name, (layout, split, config) in LAYOUTS.items():
                run_dir = Path(tmp) / f"{name.replace(' ', '_')}{round_}"
                batch = args.global_batch // split
                flags = train_args(
                    f"ds_configs/{config}.json",
                    model_dir,
                    run_dir,
                    args.steps,
                    args.block_size,
                    batch,
                    "--no-export_hf_at_end",
                    *layout,
                )
                rate, _ = train_rate(flags, 2, args.global_batch * args.block_size, args.warmup)
                rates[name].append(rate / 2)
                print(f"round {round_}: {name}: {rates[name][-1]:.0f} tokens/s per rank", flush=True)
    baseline = statistics.median(rates["data parallel 2"])
    for name, values in rates.items():
        print(f"| {name} | {median_runs(values)} | {statistics.median(values) / baseline:.2f} |")
    print(
        json.dumps(
            {
                "tokens_per_s_per_rank": rates,
                "global_batch": args.global_batch,
                "block_size": args.block_size,
                "steps": args.steps,
            }
        )
    )


if __name__ == "__main__":
    main()
