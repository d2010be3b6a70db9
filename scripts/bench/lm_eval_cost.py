"""What scoring lm-evaluation-harness tasks during training costs (BENCHMARKS.md, "lm-eval during training").

    python scripts/bench/lm_eval_cost.py [--steps 40] [--every 10] [--nprocs 2] [--rounds 2]

The default tiny Llama under ds_configs/zero3.json on --nprocs ranks, --steps steps, the local tasks of
tests/fixtures/lm_eval (multiple choice over 40 items, the perplexity of 20 docstrings, greedy generation of 12
answers) scored every --every steps and at the end, against the same run without them, alternating; then the same
tasks scored on the run's export by `lm_eval run --model hf` (one process, its own command). Reports each run's wall
time, the seconds the evaluations took (the goodput ledger's eval), and the seconds of one evaluation in the loop
against lm-eval's own (each run's `total_evaluation_time_seconds`, and the CLI's wall time with its start-up).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path


from scripts.bench.common import REPO, bench_parser, launch, timed
from scripts.launching import BIN, child_env, run

TASKS = REPO / "tests" / "fixtures" / "lm_eval"


def train(run_dir: Path, steps: int, nprocs: int, *more: str) -> float:
    flags = ["--config", "ds_configs/zero3.json", "--output_dir", str(run_dir), "--max_steps", str(steps)]
    flags += ["--block_size", "128", "--per_device_train_batch_size", "4", "--disable_tqdm", "--peak_tflops", "0.2"]
    return timed(lambda: launch("train.py", [*flags, "--logging_steps", "10", *more], nprocs))


def main(argv=None) -> int:
    parser = bench_parser(__doc__, steps=40, nprocs=2, rounds=2)
    parser.add_argument("--every", type=int, default=10, help="score every N steps (default 10)")
    args = parser.parse_args(argv)
    rows = {"with": [], "without": [], "eval": [], "one": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            scored = Path(tmp) / f"scored{round_}"
            scoring = ["--lm_eval_tasks", str(TASKS), "--lm_eval_steps", str(args.every)]
            rows["with"].append(train(scored, args.steps, args.nprocs, *scoring))
            rows["without"].append(train(Path(tmp) / f"plain{round_}", args.steps, args.nprocs))
            rows["eval"].append(json.loads((scored / "goodput.json").read_text())["seconds"]["eval"])
            final = json.loads((scored / "lm_eval" / f"step{args.steps}.json").read_text())
            rows["one"].append(float(final["total_evaluation_time_seconds"]))
        reference = Path(tmp) / "reference"
        cmd = [str(BIN / "lm_eval"), "run", "--model", "hf", "--model_args", f"pretrained={scored}", "dtype=float32"]
        cmd += ["--tasks", *map(str, sorted(TASKS.glob("*.yaml"))), "--batch_size", "8", "--device", "cpu"]
        cmd += ["--output_path", str(reference)]
        cli_wall = timed(lambda: run(cmd, child_env(), cwd=REPO))
        cli = float(json.loads(next(reference.rglob("results_*.json")).read_text())["total_evaluation_time_seconds"])
    med = {name: statistics.median(values) for name, values in rows.items()}
    evaluations = args.steps // args.every
    print(f"run with scoring   {med['with']:.1f} s  (runs: {', '.join(f'{v:.1f}' for v in rows['with'])})")
    print(f"run without        {med['without']:.1f} s  (runs: {', '.join(f'{v:.1f}' for v in rows['without'])})")
    print(f"added              {med['with'] - med['without']:.1f} s = {med['with'] / med['without'] - 1:+.0%}")
    print(f"eval in the ledger {med['eval']:.1f} s for {evaluations} evaluations")
    print(f"one evaluation     in the loop {med['one']:.2f} s, lm_eval --model hf {cli:.2f} s ({cli_wall:.1f} s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
