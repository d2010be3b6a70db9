"""What the benchmarks share: their common flags, launching train.py (or a script) under the deepspeed launcher
(through scripts/launching.py), the benchmark model, reading metrics.jsonl (scaletrain.observability's reader),
steady tokens/s, timing and the "median (run, run)" figures.

A benchmark imports from here by full path (`from scripts.bench.common import bench_parser, launch`): the editable
install (`pip install -e .`) puts the checkout on the path, so it runs as a script (`python scripts/bench/X.py`) and
imports as a module (`from scripts.bench.X import ...`) alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scaletrain.observability.metrics import METRICS_FILE, read_records
from scripts.launching import Launcher, child_env, run

REPO = Path(__file__).resolve().parents[2]

# The flags several benchmarks take: name -> (type, help). Each benchmark gives its own defaults.
SHARED_FLAGS = {
    "steps": (int, "optimizer steps of each run"),
    "warmup": (int, "steps left out of the steady figures (start-up, compilation)"),
    "rounds": (int, "rounds: the variants alternate, each run once a round; medians over the rounds"),
    "repeats": (int, "timed repeats; the median is reported"),
    "nprocs": (int, "ranks (deepspeed launcher)"),
    "block_size": (int, "tokens per block"),
    "batch": (int, "blocks per rank per micro-batch (--per_device_train_batch_size)"),
}


def bench_parser(doc: str, **defaults) -> argparse.ArgumentParser:
    """A parser that shows the benchmark's docstring and takes the shared flags named (in that order), each with
    the default given: bench_parser(__doc__, steps=60, rounds=2). The benchmark adds its own flags after."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        kind, text = SHARED_FLAGS[name]
        parser.add_argument(f"--{name}", type=kind, default=default, help=f"{text} (default {default})")
    return parser


def bench_model(folder: Path) -> Path:
    """The tiny Llama widened to ~5M parameters ("a model of a few million parameters")."""
    from data.build_tiny_llama import tiny_llama_variant

    return tiny_llama_variant(folder, hidden_size=256, intermediate_size=688, head_dim=64)


def launch(script: str, args: list, nprocs: int) -> str:
    """Run `script` (train.py, or a script of this folder) with `args` under the deepspeed launcher on `nprocs`
    ranks (the launcher's default port), from the repository, offline; its stdout. Exits with the command and its
    output's tail if it fails."""
    cmd = Launcher("deepspeed", nprocs, pick_port=False).command(script, args)
    proc = run(cmd, child_env())
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def train_args(config, model_dir: Path, run_dir: Path, steps: int, block_size: int, batch: int, *more) -> list:
    """train.py's flags for one throughput run: the DeepSpeed JSON, the model config folder, the run folder, steps,
    block size and micro-batch, no validation split and no progress bar; then `more`."""
    return [
        "--config",
        str(config),
        "--config_name",
        str(model_dir),
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(steps),
        "--block_size",
        str(block_size),
        "--per_device_train_batch_size",
        str(batch),
        "--validation_split_percentage",
        "0",
        "--disable_tqdm",
        *more,
    ]


def metrics(run_dir: Path, key: str | None = None) -> list:
    """The records of a run's metrics.jsonl (those that have `key`, if given; a last line cut short left out)."""
    records, _ = read_records(Path(run_dir) / METRICS_FILE)
    return [r for r in records if key is None or key in r]


def steady_rate(steps: list, times: list, tokens_per_step: int, warmup: int) -> float:
    """Tokens per second from the end of step `warmup` to the end of the last step."""
    first = steps.index(warmup)
    return (steps[-1] - steps[first]) * tokens_per_step / (times[-1] - times[first])


def records_rate(records: list, tokens_per_step: int, warmup: int) -> float:
    """steady_rate over metrics.jsonl records (their `step` and wall-clock `time`)."""
    return steady_rate([r["step"] for r in records], [r["time"] for r in records], tokens_per_step, warmup)


def train_rate(flags: list, nprocs: int, tokens_per_step: int, warmup: int) -> tuple:
    """(steady tokens/s, the training records) of one train.py run with `flags` (train_args) on `nprocs` ranks."""
    launch("train.py", flags, nprocs)
    records = metrics(Path(flags[flags.index("--output_dir") + 1]), "loss")
    return records_rate(records, tokens_per_step, warmup), records


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes (time.perf_counter)."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median_runs(values: list, spec: str = ".0f", scale: float = 1.0) -> str:
    """'median (run, run, ...)', each figure times `scale`, formatted with `spec`: a cell of the Markdown rows."""
    runs = ", ".join(format(v * scale, spec) for v in values)
    return f"{format(statistics.median(values) * scale, spec)} ({runs})"
