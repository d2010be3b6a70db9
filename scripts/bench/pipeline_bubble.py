"""The pipeline's bubble as measured, per stage, against the 1F1B schedule's (stages - 1) / micro-batches.

Runs train.py under pipeline parallelism 2 (ZeRO-1, 2 ranks) on the same global batch of B blocks split into 2, 4
and 8 micro-batches, and reports each stage's median bubble over the steady-state records: the seconds the stage
waited in the schedule's receives (for its neighbour: the fill and drain, and the transfers) over the seconds it
spent in forward and backward passes (the `pipeline_bubble_stage<N>` fields of metrics.jsonl).

    python scripts/bench/pipeline_bubble.py        # prints Markdown rows for BENCHMARKS.md and a JSON line

On a CPU this measures the CPU (two processes sharing 2 cores, gloo), not what a GPU node does.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from scripts.bench.common import bench_model, bench_parser, train_args, train_rate

REPO = Path(__file__).resolve().parents[2]

STAGES = 2


def main() -> None:
    parser = bench_parser(__doc__, steps=30, warmup=10, block_size=256)
    parser.add_argument("--global_batch", type=int, default=8, help="blocks per step (default 8)")
    parser.add_argument("--micro_batches", default="2,4,8", help="micro-batches a step to compare (default 2,4,8)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp) / "model")
        for m in (int(n) for n in args.micro_batches.split(",")):
            flags = train_args(
                "ds_configs/zero1.json",
                model_dir,
                Path(tmp) / f"m{m}",
                args.steps,
                args.block_size,
                args.global_batch // m,
                "--no-export_hf_at_end",
                "--logging_steps",
                "1",
                "--pipeline_parallel_size",
                str(STAGES),
                "--gradient_accumulation_steps",
                str(m),
            )
            rate, records = train_rate(flags, STAGES, args.global_batch * args.block_size, args.warmup)
            steady = [r for r in records if r["step"] > args.warmup]
            bubbles = [statistics.median(r[f"pipeline_bubble_stage{s}"] for r in steady) for s in range(STAGES)]
            results[m] = {"bubble_per_stage": bubbles, "expected": (STAGES - 1) / m, "tokens_per_s": rate}
            cells = " | ".join(f"{b:.2f}" for b in bubbles)
            print(
                f"| {m} | {args.global_batch // m} | {cells} | {statistics.mean(bubbles):.2f} | "
                f"{(STAGES - 1) / m:.3f} | {rate:.0f} |",
                flush=True,
            )
    print(json.dumps({"stages": STAGES, "global_batch": args.global_batch, "steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
