"""torch.compile (--torch_compile) against eager: steady step time and start-up cost, same model, data and batch.

Runs train.py alternately (--rounds times each) on one rank, ZeRO-2, fp32, the ~5M-parameter Llama of the overhead
benchmark, logging every step: eager, then --torch_compile (inductor). Reports the median steady step time (steps
after --warmup) and the start-up cost: the compiled run's extra time over its first --warmup steps (graph capture and
code generation happen there) against the eager run's.

    python scripts/bench/compile.py [--steps 40 --warmup 10 --rounds 2]   # Markdown rows and a JSON line

On a CPU this measures inductor's C++/OpenMP code on 2 cores, not Triton kernels on a GPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from scripts.bench.common import bench_model, bench_parser, launch, median_runs, metrics, train_args

REPO = Path(__file__).resolve().parents[2]

MODES = {"eager": [], "compiled (inductor)": ["--torch_compile"]}


def main() -> None:
    args = bench_parser(__doc__, steps=40, warmup=10, rounds=2, block_size=256, batch=4).parse_args()

    steady = {name: [] for name in MODES}
    startup = {name: [] for name in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp) / "model")
        for round_ in range(args.rounds):
            for name, mode in MODES.items():
                run_dir = Path(tmp) / f"{name.split()[0]}{round_}"
                flags = train_args(
                    "ds_configs/zero2.json",
                    model_dir,
                    run_dir,
                    args.steps,
                    args.block_size,
                    args.batch,
                    "--logging_steps",
                    "1",
                    "--no-export_hf_at_end",
                    *mode,
                )
                launch("train.py", flags, 1)
                records = metrics(run_dir, "loss")
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
        print(f"| {name} | {median_runs(steady[name], '.1f', 1e3)} | {step / eager:.2f} | {extra:+.1f} s |")
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
