"""The GPU check's report: the machine's facts, the MFU against the measured matmul rate, the Markdown table and the
JSON result. See scripts/gpu_check.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.gpu_check_checks import LOSS_RTOL, MEMORY_MARGIN, exit_code
from scripts.gpu_check_rows import Setup

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class About:
    """What the whole check ran on: the machine's facts, the mode's setup and the model's parameter count."""

    facts: dict
    setup: Setup
    n: int


def machine_facts(work: Path) -> dict:
    """What the machine has, printed before any run: Python and package versions (as installed, a `--target` folder
    on PYTHONPATH included), CUDA, the GPU and its driver, nvcc, free disk under the work folder and free memory."""
    import importlib.metadata

    import psutil

    facts = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "deepspeed", "datasets", "peft", "flash_attn"):
        try:
            facts[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts[name] = "missing"
    try:
        import torch

        facts["cuda"] = torch.version.cuda or "none (a CPU build of torch)"
        facts["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError as err:
        facts["cuda"] = facts["gpu"] = f"torch does not import ({err})"
    facts["driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    facts["nvcc"] = _first_line(["nvcc", "--version"], last=True)
    facts["free_disk_gb"] = round(shutil.disk_usage(work).free / 2**30, 1)
    facts["free_memory_gb"] = round(psutil.virtual_memory().available / 2**30, 1)
    return facts


def _first_line(cmd: list, last: bool = False) -> str:
    """A command's first (or last) line of output, or why there is none."""
    if shutil.which(cmd[0]) is None:
        return f"no {cmd[0]}"
    try:
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{cmd[0]} failed ({err})"
    return (lines[-1] if last else lines[0]).strip() if lines else f"{cmd[0]} printed nothing"


def measured_peak(setup: Setup) -> float:
    """The card's matrix-product rate in the runs' precision, measured once at the start (TFLOP/s); on a CPU, fp32."""
    from scaletrain.observability.flops import measured_matmul_tflops

    if setup.gpu:
        return measured_matmul_tflops("cuda", setup.precision, seconds=2.0, size=8192)
    return measured_matmul_tflops("cpu", "fp32", seconds=0.3, size=512)


def causal_flops_per_token(model: Path, setup: Setup) -> float:
    """Model FLOPs per token of the check's Llama with the attention term counted causally (half the T x T square),
    as Megatron-LM and FlashAttention's benchmarks count it; train.py's own MFU counts the whole square (PaLM)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.observability.flops import model_flops

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return model_flops(meta, config, setup.block_size).per_token(causal=True)


def add_measured_mfu(rows: dict, flops_per_token: float, peak_tflops: float) -> None:
    """MFU against the measured rate, causal attention, for the rows that trained the check's Llama in full (not the
    default job's tiny model, not QLoRA's frozen base)."""
    for name, row in rows.items():
        if row.tokens_per_s and peak_tflops > 0 and name not in ("default", "qlora", "dpo", "long_context"):
            row.mfu_causal_measured = row.tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def header(about: About, total: float, work: Path) -> str:
    """The table's heading: the mode, the model, the batch, the tolerances, the time and where the logs are."""
    setup = about.setup
    return (
        f"## GPU check ({'GPU' if setup.gpu else 'CPU test mode'}): {about.n / 1e9:.2f}B-parameter Llama "
        f"(hidden {setup.hidden_size}, {setup.layers} layers, {setup.heads} heads / {setup.kv_heads} key/value,"
        f" vocab {setup.vocab_size}), {setup.batch} x {setup.block_size} tokens per step, 1 "
        f"{'GPU' if setup.gpu else 'CPU rank'}; loss tolerance {LOSS_RTOL:g} relative, memory margin "
        f"{MEMORY_MARGIN:.0%}; total {total:.0f}s; work dir {work} (each row's log: WORK_DIR/<run>.log). MFU: "
        f"PaLM's count (attention's whole T x T square) over the datasheet peak, as train.py logs it; beside it, "
        f"attention counted causally over the matrix-product rate measured on this device at the start "
        f"({about.facts['measured_matmul_tflops']:g} TFLOP/s), the figure peers (Megatron-LM, FlashAttention) report"
    )


def render(rows: dict, heading: str) -> str:
    lines = [
        heading,
        "",
        "| run | what | steps | tokens/s | MFU | MFU causal/measured | peak GPU GB | planned GB | check | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        took = f" ({row.seconds:.0f}s)" if row.seconds is not None else ""
        lines.append(
            f"| {row.run} | {row.what} | {_num(row.steps, 'd')} | {_num(row.tokens_per_s, '.0f')} | "
            f"{_num(row.mfu, '.1%')} | {_num(row.mfu_causal_measured, '.1%')} | {_num(row.peak_gb, '.2f')} | "
            f"{_num(row.planned_gb, '.2f')} | "
            f"{'; '.join(row.checks)} | {row.status}{took} |"
        )
    return "\n".join(lines)


def write_result(path: Path, about: About, started: float, rows: dict, planned: dict, reference) -> None:
    """The rows so far as JSON: written after every row, so a check cut short still leaves what it measured."""
    result = {
        "machine": about.facts,  # measured_matmul_tflops: the peak of the "MFU causal/measured" column
        "setup": dataclasses.asdict(about.setup),
        "parameters": about.n,
        "total_s": round(time.monotonic() - started, 1),
        "exit_code": exit_code(rows),
        "finished": all(row.status != "not run" for row in rows.values()),
        "planned_gb": {f"zero{k[0]}{'_ckpt' if k[1] else ''}": v for k, v in planned.items()},
        "loss_reference": reference,
        "rows": [dataclasses.asdict(r) for r in rows.values()],
    }
    path.write_text(json.dumps(result, indent=2))
