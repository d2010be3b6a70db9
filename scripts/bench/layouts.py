"""Throughput of each parallel layout against pure data parallelism, same model, data, global batch and ranks.

Runs train.py alternately (--rounds times each) at 2 ranks: data parallelism (ZeRO-2, micro-batch B/2 per rank),
tensor parallelism 2 and sequence parallelism 2 (ZeRO-2, both ranks read the same micro-batch of B; under SP each
keeps half of every block's tokens), pipeline parallelism 2 (ZeRO-1, its engine takes no ZeRO-2: 4 micro-batches of
B/4 through the 1F1B schedule), on the same global batch of B blocks,
and reports steady-state tokens/s per rank (tokens between the end of step --warmup and the last step, over the
wall-clock stamps of metrics.jsonl, divided by the ranks).

    python scripts/bench/layouts.py               # prints Markdown rows for BENCHMARKS.md and a JSON line
    python scripts/bench/layouts.py --ranks 8     # 8 ranks, ZeRO-1: DP 8, TP 2 x DP 4, PP 2 x DP 4, and composed:
                                                  # TP 2 x PP 2 x DP 2, TP 2 x SP 2 x DP 2

On a CPU this measures the CPU (gloo, shared-memory all-reduce, 2 cores), not what a GPU node with NVLink does.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from scripts.bench.common import bench_model, bench_parser, median_runs, train_args, train_rate

REPO = Path(__file__).resolve().parents[2]

TP2, PP2 = ["--tensor_parallel_size", "2"], ["--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "4"]
LAYOUTS = {  # ranks -> {name -> (flags, micro-batch as a fraction of the global batch, ZeRO config)}; baseline first
    2: {
        "data parallel 2": ([], 2, "zero2"),
        "tensor parallel 2": (TP2, 1, "zero2"),
        "sequence parallel 2": (["--sequence_parallel_size", "2"], 1, "zero2"),
        "pipeline parallel 2": (PP2, 4, "zero1"),
    },
    # 8 ranks, ZeRO-1 throughout (the pipeline engine's): each kind alone with data parallelism, and composed.
    8: {
        "data parallel 8": ([], 8, "zero1"),
        "tensor parallel 2 x data parallel 4": (TP2, 4, "zero1"),
        "pipeline parallel 2 x data parallel 4": (PP2, 16, "zero1"),
        "tensor 2 x pipeline 2 x data parallel 2": ([*TP2, *PP2], 8, "zero1"),
        # each replica's 8 blocks read by its 4 ranks: 2 tensor ranks x 2 sequence shards of 128 tokens
        "tensor 2 x sequence 2 x data parallel 2": ([*TP2, "--sequence_parallel_size", "2"], 2, "zero1"),
    },
}


def main() -> None:
    parser = bench_parser(__doc__, steps=40, warmup=10, rounds=2, block_size=256)
    parser.add_argument("--global_batch", type=int, default=None, help="blocks per step (default 8; 16 at 8 ranks)")
    parser.add_argument("--ranks", type=int, choices=sorted(LAYOUTS), default=2)
    args = parser.parse_args()
    layouts, ranks = LAYOUTS[args.ranks], args.ranks
    args.global_batch = args.global_batch or (8 if ranks == 2 else 16)

    rates = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp) / "model")
        for round_ in range(args.rounds):
            for name, (layout, split, config) in layouts.items():
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
                rate, _ = train_rate(flags, ranks, args.global_batch * args.block_size, args.warmup)
                rates[name].append(rate / ranks)
                print(f"round {round_}: {name}: {rates[name][-1]:.0f} tokens/s per rank", flush=True)
    baseline = statistics.median(next(iter(rates.values())))
    for name, values in rates.items():
        print(f"| {name} | {median_runs(values)} | {statistics.median(values) / baseline:.2f} |")
    print(
        json.dumps(
            {
                "tokens_per_s_per_rank": rates,
                "global_batch": args.global_batch,
                "ranks": ranks,
                "block_size": args.block_size,
                "steps": args.steps,
            }
        )
    )


if __name__ == "__main__":
    main()
