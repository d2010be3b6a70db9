"""torch.compile (--torch_compile) against eager: steady step time and start-up cost, same model, data and batch.

Runs train.py alternately (--rounds times each) on one rank, ZeRO-2, fp32, the ~5M-parameter Llama of the overhead
benchmark, logging every step: eager, then --torch_compile (inductor). Reports the median steady step time (steps
after --warmup) and the start-up cost: the compiled run's extra time over its first --warmup steps (graph capture and
code generation happen there) against the eager run's.

    python scripts/bench_compile.py [--steps 40 --warmup 10 --rounds 2]   # Markdown rows and a JSON line

On a CPU this measures inductor's C++/OpenMP code on 2 cores, not Triton kernels on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_overhead import bench_model, launch  # noqa: E402

MODES = {"eager": [], "compiled (inductor)": ["--torch_compile"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    steady = {name: [] for name in MODES}
    startup = {name: [] for name in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp) / "model")
        for round_ in range(args.rounds):
            for name, flags in MODES.items():
                run_dir = Path(tmp) / f"{name.split()[0]}{round_}"
                launch(
                    "train.py",
                    [
                        "--config",
                        "ds_configs/zero2.json",
                        "--config_name",
                        str(model_dir),
                        "--output_dir",
                        str(run_dir),
                        "--max_steps",
                        str(args.steps),
                        "--logging_steps",
                        "1",
                        "--block_size",
                        str(args.block_size),
                        "--per_device_train_batch_size",
                        str(args.batch),
                        "--validation_split_percentage",
                        "0",
                        "--no-export_hf_at_end",
                        "--disable_tqdm",
                        *flags,
                    ],
                    1,
                )
                records = [
                    r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r
                ]
                times = [r["step_time_s"] for r in records]
                steady[name].append(statistics.median(times[args.warmup :]))
                startup[name].append(sum(times[: args.warmup]))
                print(
                    f"round {round_}: {name}: {steady[name][-1] * 1e3:.1f} ms/step steady, first {args.warmup} "
                    f"steps {startup[name][-1]:.1f} s",
                    flush=True,
                )
    eager = statistics.median(steady["eager"])
    for name in MODES:
        step = statistics.median(steady[name])
        extra = statistics.median(startup[name]) - statistics.median(startup["eager"])
        print(
            f"| {name} | {step * 1e3:.1f} ({', '.join(f'{v * 1e3:.1f}' for v in steady[name])}) | "
            f"{step / eager:.2f} | {extra:+.1f} s |"
        )
    print(
        json.dumps(
            {
                "steady_step_s": steady,
                f"first_{args.warmup}_steps_s": startup,
                "steps": args.steps,
                "block_size": args.block_size,
                "batch": args.batch,
            }
        )
    )


if __name__ == "__main__":
    main()
