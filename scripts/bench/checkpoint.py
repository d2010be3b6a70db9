"""Checkpoint benchmark: save and load seconds against checkpoint size; start-to-first-step after a resume at an
early and at a late data position (equal within noise: a resume seeks to its position, it replays no data).

    python scripts/bench/checkpoint.py            # prints Markdown rows for BENCHMARKS.md and JSON lines

Sizes: the tiny Llama widened (hidden 128 / 512 / 1024), ZeRO-2, 2 ranks, fp32, one committed checkpoint each;
the save and load seconds are the ones train.py logs (DeepSpeed save + commit; DeepSpeed load + train state), and
within the save, rank 0's SHA-256 of its files; on load, rank 0's SHA-256 check of its share (before the load).
Resume position: one 2-rank run of the tiny Llama saves at step 2 (early) and at step --late (late, late in the
first epoch); each is resumed in a fresh process timed from Popen to the wall-clock stamp of its first step.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from data.build_tiny_llama import tiny_llama_variant
from scripts.bench.common import bench_parser, launch, metrics

REPO = Path(__file__).resolve().parents[2]

COMMON = [
    "--config",
    "ds_configs/zero2.json",
    "--block_size",
    "64",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "--no-export_hf_at_end",
    "--max_eval_samples",
    "8",
]


def model(folder: Path, hidden: int, layers: int) -> Path:
    return tiny_llama_variant(
        folder, hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers, head_dim=hidden // 4
    )  # the tiny Llama's 4 heads


def train(args: list, nprocs: int = 2) -> tuple:
    """(the wall-clock time at the launch, train.py's stdout) of one run with COMMON and `args`."""
    started = time.time()
    return started, launch("train.py", [*COMMON, *args], nprocs)


def seconds(pattern: str, text: str) -> list:
    return [float(x) for x in re.findall(pattern, text)]


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = bench_parser(__doc__, rounds=3)
    parser.add_argument("--late", type=int, default=400, help="the late save step (the first epoch has 435)")
    parser.add_argument("--positions_only", action="store_true", help="skip the save/load sizes part")
    parser.add_argument("--sizes_only", action="store_true", help="skip the resume-position part")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    rows = []
    for hidden, layers in () if args.positions_only else ((128, 4), (512, 8), (1024, 8)):
        folder = model(tmp / f"m{hidden}", hidden, layers)
        out = tmp / f"run{hidden}"
        run = ["--config_name", str(folder), "--tokenizer_name", str(folder), "--output_dir", str(out)]
        run += ["--max_steps", "2", "--per_device_train_batch_size", "2"]
        _, log = train(run)
        size = dir_bytes(out / "checkpoints" / "step2")
        save = seconds(r"saved checkpoint \S+ in ([\d.]+)s", log)[-1]
        save_hash = seconds(r"saved checkpoint \S+ in [\d.]+s \(of which SHA-256 ([\d.]+)s on rank 0", log)[-1]
        loads, checks = [], []
        for _ in range(args.rounds):
            _, log = train([*run, "--resume_from_checkpoint", str(out / "checkpoints" / "step2")])
            loads += seconds(r"resumed from \S+ \(step \d+, \d+ samples seen\) in ([\d.]+)s", log)[:1]
            checks += seconds(r"checked the SHA-256 of \d+ of \S+ files \([\d.]+ MB\) in ([\d.]+)s on rank 0", log)[:1]
        rows.append(
            {
                "hidden": hidden,
                "layers": layers,
                "checkpoint_mb": size / 2**20,
                "save_s": save,
                "save_sha256_s": save_hash,
                "load_s": statistics.median(loads),
                "load_sha256_check_s": statistics.median(checks),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(out)

    if args.sizes_only:
        shutil.rmtree(tmp)
        return
    # Start-to-first-step after resume, early against late data position (the tiny Llama, 4 blocks x 2 ranks).
    saved = {}
    for label, step in (("early", 2), ("late", args.late)):
        saved[label] = tmp / f"saved_{label}"
        train(
            [
                "--output_dir",
                str(saved[label]),
                "--max_steps",
                str(step),
                "--per_device_train_batch_size",
                "4",
                "--logging_steps",
                "50",
            ]
        )
    first_step = {"early": [], "late": []}
    for _ in range(args.rounds):
        for label, step in (("early", 2), ("late", args.late)):
            resumed = tmp / "resumed"
            shutil.rmtree(resumed, ignore_errors=True)
            shutil.copytree(saved[label], resumed)
            started, _ = train(
                ["--output_dir", str(resumed), "--max_steps", str(step + 1), "--per_device_train_batch_size", "4"]
            )  # --resume_from_checkpoint auto
            [first] = [r for r in metrics(resumed, "tokens_per_s") if r["step"] == step + 1]
            first_step[label].append(round(first["time"] - started, 2))
    first_step["ratio_late_over_early"] = statistics.median(first_step["late"]) / statistics.median(first_step["early"])
    print(json.dumps(first_step))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
