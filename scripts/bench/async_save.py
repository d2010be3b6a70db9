"""Asynchronous against synchronous saves: what saves add to a run's steps, the stall of each save, and the step time
while a write is in flight.

    python scripts/bench/async_save.py            # prints Markdown rows for BENCHMARKS.md and JSON lines

The sizes of scripts/bench/checkpoint.py (the tiny Llama widened: hidden 128 / 512 / 1024), ZeRO-2, one rank,
fp32, OMP_NUM_THREADS=1 (one of the two cores trains, the other is left for the writer process). For each size,
three runs of --steps steps from the same start: no saves (the baseline), --save_steps --every with
--no-async_save, and the same with --async_save. What saves add: the sum of the steps' wall-clock times
(metrics.jsonl's step_time_s, which includes the time a save held the next step) minus the baseline's. The
stall of one save: train.py's "saved checkpoint ... in Ns" (synchronous) or "snapshot taken in Ns" (asynchronous),
median. Step time while a write is in flight: the median step_time_s of the steps right after an asynchronous
save (its write running beside them) against the baseline's median step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import tempfile
from pathlib import Path

from scripts.bench.checkpoint import COMMON, dir_bytes, model, seconds
from scripts.bench.common import bench_parser, launch, metrics

REPO = Path(__file__).resolve().parents[2]


def run(folder: Path, out: Path, steps: int, every: int, mode: str) -> tuple:
    """(train.py's log, its per-step records) of one single-rank run; mode: "none", "sync" or "async"."""
    args = [*COMMON, "--config_name", str(folder), "--tokenizer_name", str(folder), "--output_dir", str(out)]
    args += ["--max_steps", str(steps), "--per_device_train_batch_size", "2", "--no-save_at_end"]
    args += ["--save_steps", "0" if mode == "none" else str(every)]
    args += ["--no-async_save"] if mode == "sync" else ["--async_save"]
    log = launch("train.py", args, 1)
    return log, [r for r in metrics(out, "step_time_s")]


def main() -> None:
    parser = bench_parser(__doc__, rounds=1)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--sizes", default="128,512,1024")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="bench_async_"))
    layers = {128: 4, 512: 8, 1024: 8}
    for hidden in map(int, args.sizes.split(",")):
        folder = model(tmp / f"m{hidden}", hidden, layers[hidden])
        row = {"hidden": hidden, "layers": layers[hidden]}
        records, logs = {}, {}
        for mode in ("none", "sync", "async"):
            out = tmp / f"{mode}{hidden}"
            logs[mode], records[mode] = run(folder, out, args.steps, args.every, mode)
            if mode == "sync":
                row["checkpoint_mb"] = round(dir_bytes(out / "checkpoints" / f"step{args.every}") / 2**20, 1)
            shutil.rmtree(out)
        total = {mode: sum(r["step_time_s"] for r in records[mode]) for mode in records}
        row["added_sync_s"] = round(total["sync"] - total["none"], 2)
        row["added_async_s"] = round(total["async"] - total["none"], 2)
        row["added_ratio"] = round(row["added_async_s"] / row["added_sync_s"], 3)
        row["stall_sync_s"] = statistics.median(seconds(r"saved checkpoint \S+ in ([\d.]+)s", logs["sync"]))
        row["stalls_sync_s"] = seconds(r"saved checkpoint \S+ in ([\d.]+)s", logs["sync"])
        row["stalls_async_s"] = seconds(r"snapshot taken in ([\d.]+)s", logs["async"])
        row["stall_async_s"] = statistics.median(row["stalls_async_s"])
        saves = set(range(args.every, args.steps, args.every))
        during = [r["step_time_s"] for r in records["async"] if r["step"] - 1 in saves]  # holds the snapshot too
        after = [r["step_time_s"] for r in records["async"] if r["step"] - 2 in saves]  # the write beside it
        base = statistics.median(r["step_time_s"] for r in records["none"])
        row["step_s_baseline"] = round(base, 3)
        row["step_s_write_in_flight"] = round(statistics.median(after), 3)
        row["step_s_with_snapshot"] = round(statistics.median(during), 3)
        waits = re.findall(r"committed checkpoint \S+, written in the background in ([\d.]+)s", logs["async"])
        row["background_write_s"] = statistics.median(map(float, waits)) if waits else None
        print(json.dumps(row), flush=True)
        print(
            f"| {hidden} / {layers[hidden]} | {row['checkpoint_mb']} | {row['added_sync_s']} | {row['added_async_s']} "
            f"| **{row['added_ratio']}** | {row['stall_sync_s']} | {row['stall_async_s']} | "
            f"{row['step_s_baseline']} | {row['step_s_write_in_flight']} |",
            flush=True,
        )
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
