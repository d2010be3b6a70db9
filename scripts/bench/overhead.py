"""Pipeline overhead benchmark: train.py against a minimal DeepSpeed loop, same model, data, batch and config.

Runs both (alternating, --rounds times each) with 2 ranks, ZeRO-2, fp32 on CPU (or the GPUs there are), and
reports steady-state tokens/s: tokens between the end of step --warmup and the last step, over wall-clock time.
The pipeline's times come from the wall-clock stamps in its metrics.jsonl (default --logging_steps 10).

    python scripts/bench/overhead.py               # prints a Markdown row for BENCHMARKS.md and a JSON line
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from scripts.bench.common import (
    bench_model,
    bench_parser,
    launch,
    metrics,
    records_rate,
    steady_rate,
    train_args,
)

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    args = bench_parser(__doc__, steps=60, warmup=10, rounds=2, nprocs=2, block_size=256, batch=4).parse_args()

    pipeline_rates, minimal_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp) / "model")
        for round_ in range(args.rounds):
            run_dir = Path(tmp) / f"pipeline{round_}"
            flags = train_args("ds_configs/zero2.json", model_dir, run_dir, args.steps, args.block_size, args.batch)
            launch("train.py", flags, args.nprocs)
            records = metrics(run_dir, "loss")
            # Same token definition as the baseline: whole blocks per step (padding only in the epoch's last block).
            tokens_per_step = args.batch * args.nprocs * args.block_size
            pipeline_rates.append(records_rate(records, tokens_per_step, args.warmup))

            out = launch("scripts/bench/minimal_ds_loop.py", [str(run_dir), str(args.steps)], args.nprocs)
            result = json.loads(next(x for x in out.splitlines() if x.startswith("MINIMAL ")).split(" ", 1)[1])
            steps = list(range(1, len(result["times"]) + 1))
            minimal_rates.append(steady_rate(steps, result["times"], result["tokens_per_step"], args.warmup))
            print(
                f"round {round_}: pipeline {pipeline_rates[-1]:.0f} tok/s, minimal {minimal_rates[-1]:.0f} tok/s",
                flush=True,
            )

    pipeline, minimal = statistics.median(pipeline_rates), statistics.median(minimal_rates)
    overhead = 1.0 - pipeline / minimal
    print(
        json.dumps(
            {
                "pipeline_tokens_per_s": round(pipeline),
                "minimal_tokens_per_s": round(minimal),
                "ratio": round(pipeline / minimal, 4),
                "overhead": round(overhead, 4),
                "pipeline_runs": [round(x) for x in pipeline_rates],
                "minimal_runs": [round(x) for x in minimal_rates],
            }
        )
    )
    print(
        f"| pipeline overhead, ZeRO-2, {args.nprocs} ranks, fp32 | {pipeline:.0f} tok/s | {minimal:.0f} tok/s | "
        f"{pipeline / minimal:.3f} ({overhead:+.1%} overhead) |"
    )


if __name__ == "__main__":
    main()
