"""Metrics overhead benchmark: train.py logging every step against every 100 steps, same job, one command.

2 ranks (deepspeed launcher), ZeRO-2, the tiny default model with small steps (4 x 64 tokens per rank), which is
the worst case for the relative cost of metrics. Runs alternate (--rounds each); the rate is measured between the
records of steps 100 and 400, which both settings write.

    python scripts/bench_metrics_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def seconds_per_step(logging_steps: int, run_dir: Path, nprocs: int) -> float:
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        str(nprocs),
        "train.py",
        "--config",
        "ds_configs/zero2.json",
        "--output_dir",
        str(run_dir),
        "--max_steps",
        "400",
        "--logging_steps",
        str(logging_steps),
        "--block_size",
        "64",
        "--per_device_train_batch_size",
        "4",
        "--max_eval_samples",
        "8",
        "--disable_tqdm",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    stamps = {
        r["step"]: r["time"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "time" in r
    }
    return (stamps[400] - stamps[100]) / 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
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
