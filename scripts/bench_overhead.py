"""Pipeline overhead benchmark: train.py against a minimal DeepSpeed loop, same model, data, batch and config.

Runs both (alternating, --rounds times each) with 2 ranks, ZeRO-2, fp32 on CPU (or the GPUs there are), and
reports steady-state tokens/s: tokens between the end of step --warmup and the last step, over wall-clock time.
The pipeline's times come from the wall-clock stamps in its metrics.jsonl (default --logging_steps 10).

    python scripts/bench_overhead.py               # prints a Markdown row for BENCHMARKS.md and a JSON line
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
sys.path.insert(0, str(REPO))

from data.build_tiny_llama import tiny_llama_variant  # noqa: E402

BIN = Path(sys.executable).parent


def bench_model(folder: Path) -> Path:
    """The tiny Llama widened to ~5M parameters ("a model of a few million parameters")."""
    return tiny_llama_variant(folder, hidden_size=256, intermediate_size=688, head_dim=64)


def launch(script: str, args: list, nprocs: int) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nprocs), script, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def steady_rate(steps: list, times: list, tokens_per_step: int, warmup: int) -> float:
    """Tokens per second from the end of step `warmup` to the end of the last step."""
    first = steps.index(warmup)
    return (steps[-1] - steps[first]) * tokens_per_step / (times[-1] - times[first])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    pipeline_rates, minimal_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp) / "model")
        for round_ in range(args.rounds):
            run_dir = Path(tmp) / f"pipeline{round_}"
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
                    "--block_size",
                    str(args.block_size),
                    "--per_device_train_batch_size",
                    str(args.batch),
                    "--validation_split_percentage",
                    "0",
                    "--disable_tqdm",
                ],
                args.nprocs,
            )
            records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            records = [r for r in records if "loss" in r]
            # Same token definition as the baseline: whole blocks per step (padding only in the epoch's last block).
            tokens_per_step = args.batch * args.nprocs * args.block_size
            pipeline_rates.append(
                steady_rate([r["step"] for r in records], [r["time"] for r in records], tokens_per_step, args.warmup)
            )

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
