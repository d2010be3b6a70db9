"""Metrics overhead benchmark: train.py logging every step against every 100 steps, same job, one command.

2 ranks (deepspeed launcher), ZeRO-2, the tiny default model with small steps (4 x 64 tokens per rank), which is
the worst case for the relative cost of metrics. Runs alternate (--rounds each); the rate is measured between the
records of steps 100 and 400, which both settings write.

    python scripts/bench/metrics_overhead.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from scripts.bench.common import bench_parser, launch, metrics

REPO = Path(__file__).resolve().parents[2]


def seconds_per_step(logging_steps: int, run_dir: Path, nprocs: int) -> float:
    flags = ["--config", "ds_configs/zero2.json", "--output_dir", str(run_dir), "--max_steps", "400"]
    flags += ["--logging_steps", str(logging_steps), "--block_size", "64", "--per_device_train_batch_size", "4"]
    launch("train.py", [*flags, "--max_eval_samples", "8", "--disable_tqdm"], nprocs)
    stamps = {r["step"]: r["time"] for r in metrics(run_dir, "time")}
    return (stamps[400] - stamps[100]) / 300


def main() -> None:
    args = bench_parser(__doc__, rounds=2, nprocs=2).parse_args()
    every, sparse = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            every.append(seconds_per_step(1, Path(tmp) / f"every{i}", args.nprocs))
            sparse.append(seconds_per_step(100, Path(tmp) / f"sparse{i}", args.nprocs))
            print(
                f"round {i}: every step {every[-1] * 1000:.1f} ms/step, every 100 {sparse[-1] * 1000:.1f} ms/step",
                flush=True,
            )
    a, b = statistics.median(every), statistics.median(sparse)
    print(
        json.dumps(
            {"every_step_ms": round(a * 1000, 2), "every_100_ms": round(b * 1000, 2), "overhead": round(a / b - 1, 4)}
        )
    )


if __name__ == "__main__":
    main()
