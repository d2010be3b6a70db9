"""Running the GPU check's rows: each kind of row launched as a child process, and its figures read back into its Row.

See scripts/gpu_check.py.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scaletrain.observability.metrics import METRICS_FILE, read_records
from scripts.launching import Launcher, run
from scripts.gpu_check_checks import dpo_check
from scripts.gpu_check_rows import FAILED, OK, PAIRS, PRETRAINED, Row, Setup, Spec
from scripts.gpu_check_rows import save_pretrained_base, write_pairs

REPO = Path(__file__).resolve().parents[1]

LONG_CONTEXT_GOAL = 2**20  # tokens in one block on one H200 (ALST: 500K on one H100-80GB)


@dataclass(frozen=True)
class Context:
    """What every row runs with: the mode, the work folder, the children's environment, the model folder, the
    seconds a run may take and the GPU memory the plan sizes for."""

    setup: Setup
    work: Path
    env: dict
    model: Path
    timeout: float
    gpu_memory_gb: float


def run_row(spec: Spec, row: Row, ctx: Context) -> dict | None:
    """One row of the check; the plan's figures for a `plan` row. Anything that stops a row from starting (a missing
    program, a folder that cannot be written) makes that row FAILED, with the reason: the next row still runs."""
    try:
        if spec.kind == "ops":
            run_ops(row, ctx.env, ctx.timeout)
        elif spec.kind == "plan":
            return run_plan(spec, ctx.env, ctx.timeout, row, ctx.gpu_memory_gb)
        elif spec.kind == "hf":
            run_hf(spec, ctx.setup, ctx.work, ctx.env, ctx.timeout, row)
        elif spec.kind == "longest":
            run_longest(ctx.setup, ctx.work, ctx.env, ctx.timeout, row)
        else:
            if "--model_name_or_path" in spec.args:
                save_pretrained_base(ctx.model, ctx.work / PRETRAINED)
            if spec.name == "dpo":
                write_pairs(ctx.work / PAIRS, ctx.setup)
            run_train(spec, ctx.setup, ctx.work, ctx.env, ctx.timeout, row)
    except Exception as err:
        row.status, row.checks = FAILED, [f"could not run: {type(err).__name__}: {err}; log {row.log}"]
    return None


def launch(cmd: list, log: Path, env: dict, timeout: float) -> str | None:
    """Run `cmd` from the repository with its output in `log`; None when it exits 0, else why not."""
    try:
        proc = run(cmd, env, timeout=timeout, log=log)
    except subprocess.TimeoutExpired:
        return f"ran past {timeout:.0f}s"
    return None if proc.returncode == 0 else f"exit {proc.returncode}"


def run_train(spec: Spec, setup: Setup, work: Path, env: dict, timeout: float, row: Row) -> None:
    out = work / spec.name
    # DeepSpeed's runner as a module: no launcher script assumed (a `pip install --target` puts none beside python)
    cmd = Launcher("deepspeed", 1).command(
        "train.py",
        [
            *spec.args,
            *("--output_dir", str(out), "--logging_steps", "1"),
            *("--no-export_hf_at_end", "--no-save_at_end", "--disable_tqdm"),
        ],
    )
    if spec.steps and "--max_steps" not in spec.args:
        cmd += ["--max_steps", str(spec.steps)]
    problem = launch(cmd, Path(row.log), env, timeout)
    if problem:
        row.status, row.checks = FAILED, [f"{problem}; log {row.log}"]
        return
    records, _ = read_records(out / METRICS_FILE)
    figures = train_figures(records, setup.warmup)
    row.steps, row.tokens_per_s, row.mfu = figures["steps"], figures["tokens_per_s"], figures["mfu"]
    row.peak_gb, row.losses = figures["peak_gb"], figures["losses"]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a preemption's checkpoint: ~14 GB per 1B run
    row.status = OK
    if not row.losses or not all(math.isfinite(x) for x in row.losses):
        row.fail_check(f"non-finite or no losses: {row.losses}")
    if spec.name == "dpo":
        dpo_check(row, [r for r in records if "loss" in r and r["step"] > setup.warmup])


def train_figures(records: list, warmup: int) -> dict:
    """Steps, losses, steady tokens/s and MFU (medians of the records after step `warmup`; all of them if the run
    was shorter), peak GPU GB (None on a CPU)."""
    train = [r for r in records if "loss" in r]
    steady = [r for r in train if r["step"] > warmup] or train
    median = lambda key: statistics.median(r[key] for r in steady) if steady and key in steady[0] else None  # noqa
    peaks = [r["gpu_peak_gb"] for r in records if "gpu_peak_gb" in r]
    return {
        "steps": train[-1]["step"] if train else 0,
        "losses": [r["loss"] for r in train],
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "peak_gb": max(peaks) if peaks else None,
    }


def run_plan(spec: Spec, env: dict, timeout: float, row: Row, gpu_memory_gb: float) -> dict:
    cmd = [sys.executable, "train.py", "--plan", *spec.args, "--num_gpus", "1", "--gpu_memory_gb", f"{gpu_memory_gb:g}"]
    problem = launch(cmd, Path(row.log), env, timeout)
    if problem:
        row.status, row.checks = FAILED, [f"{problem}; log {row.log}"]
        return {}
    planned = parse_plan(Path(row.log).read_text())
    if not planned:
        row.status, row.checks = FAILED, [f"no ZeRO-1/2/3 rows in the --plan output; log {row.log}"]
        return {}
    row.status = OK
    row.checks = [
        ", ".join(f"ZeRO-{stage}{' ckpt' if ckpt else ''} {gb:.2f}" for (stage, ckpt), gb in sorted(planned.items()))
    ]
    return planned


def parse_plan(text: str) -> dict:
    """{(ZeRO stage, checkpointing): planned GB per GPU} from the table `train.py --plan` prints: the rows named
    exactly ZeRO-1, ZeRO-2 and ZeRO-3 (no offload), their 'total (no ckpt / ckpt)' column."""
    header, planned = None, {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| option |"):
            header = cells
        elif header and line.startswith("| ZeRO-") and cells[0] in ("ZeRO-1", "ZeRO-2", "ZeRO-3"):
            without, with_ckpt = (float(x) for x in cells[header.index("total (no ckpt / ckpt)")].split("/"))
            stage = int(cells[0][-1])
            planned[(stage, False)], planned[(stage, True)] = without, with_ckpt
    return planned


def hf_command(spec: Spec, setup: Setup, work: Path, timeout: float) -> list:
    """compare_hf_trainer.py's throughput measure, one round, on the check's model, batch and ZeRO-2."""
    shape = ("--hidden_size", setup.hidden_size, "--layers", setup.layers, "--heads", setup.heads)
    shape += ("--kv_heads", setup.kv_heads, "--vocab_size", setup.vocab_size, "--block_size", setup.block_size)
    flags = (
        *("--measure", "throughput", "--ranks", 1, "--precision", setup.precision, "--zero_stage", 2, "--rounds", 1),
        *shape,
        *("--batch", setup.batch, "--steps", spec.steps, "--warmup", setup.warmup, "--logging_steps", 1),
        *("--learning_rate", setup.learning_rate, "--lr_warmup_steps", setup.lr_warmup_steps),
        *("--max_rss_gb", 100, "--timeout", int(timeout), "--work_dir", work / "hf", "--json", work / "hf.json"),
    )
    return [sys.executable, "scripts/compare_hf_trainer.py", *(str(x) for x in flags)]


def run_hf(spec: Spec, setup: Setup, work: Path, env: dict, timeout: float, row: Row) -> float | None:
    """compare_hf_trainer.py's throughput measure on the check's model and batch; the train.py / HF ratio."""
    problem = launch(hf_command(spec, setup, work, timeout), Path(row.log), env, timeout * 2 + 60)
    if problem:
        row.status, row.checks = FAILED, [f"{problem}; log {row.log}"]
        return None
    result = json.loads((work / "hf.json").read_text())["throughput"]
    row.steps, row.status = spec.steps, OK
    row.tokens_per_s = result["median"]["hf_trainer"]["tokens_per_s"]
    ratio = result["ratio"]["tokens_per_s"]
    ours = result["median"]["train.py"]["tokens_per_s"]
    row.checks = [f"train.py / HF tokens/s = {ratio:.3f} (train.py {ours:.0f}, time stamps from step {setup.warmup})"]
    return ratio


def run_longest(setup: Setup, work: Path, env: dict, timeout: float, row: Row) -> None:
    """scripts/bench/longest_block.py: the longest block that trains, its step time and peak; on a GPU the check
    is the 1M-token goal."""
    cmd = [sys.executable, "scripts/bench/longest_block.py", "--work_dir", str(work / "long_context")]
    cmd += ["--timeout", str(int(timeout))] + ([] if setup.gpu else ["--cpu_test"])
    problem = launch(cmd, Path(row.log), env, timeout * 8)
    lines = Path(row.log).read_text().strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if summary is None or not summary["longest_tokens"]:
        row.status, row.checks = FAILED, [f"{problem or 'no block trained'}; log {row.log}"]
        return
    best = next(a for a in summary["attempts"] if a["tokens"] == summary["longest_tokens"])
    row.status, row.steps, row.peak_gb, row.tokens_per_s = OK, 1, best["peak_gb"], summary["tokens_per_s"]
    tokens = summary["longest_tokens"]
    row.checks = [
        f"longest block {tokens} tokens{f' ({tokens // 1024}K)' if tokens >= 1024 else ''}, step "
        f"{summary['step_s']} s; stopped by {summary['stopped_by']}"
    ]
    if setup.gpu and tokens < LONG_CONTEXT_GOAL:
        row.fail_check(f"below the goal of {LONG_CONTEXT_GOAL // 1024}K tokens")


def run_ops(row: Row, env: dict, timeout: float) -> None:
    cmd = [sys.executable, "scripts/build_ops.py", "--config", "ds_configs/zero2.json"]
    problem = launch(cmd, Path(row.log), env, timeout)
    row.status, row.checks = (FAILED, [f"{problem}; log {row.log}"]) if problem else (OK, [])
