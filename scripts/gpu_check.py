"""The prepared GPU check: one command, one H100/H200-class GPU, one table, exit non-zero on failure.

    bash scripts/gpu_check.sh [--work_dir DIR] [--only NAME,...] [--skip NAME,...]
    python scripts/gpu_check.py --cpu_test            # the same program on a CPU: tiny model, fp32 (what tests run)

Runs, in order (one GPU, `deepspeed --num_gpus 1 train.py ...`, each logging every step, without the HF export):

- `ops`: scripts/build_ops.py builds FusedAdam once, so no timed run pays for the JIT build.
- `plan`: `train.py --plan` for the ~1B Llama below: the planned GB per GPU of ZeRO-1/2/3, with and without
  activation checkpointing, which the measured peaks are held against.
- `default`: the default job (README: `deepspeed train.py --config ds_configs/zero3.json`) with --bf16.
- `zero1`, `zero2`, `zero3`: the ~1B Llama (hidden 2048, 18 layers, 16 heads / 8 key/value, MLP 5456, vocab
  32000: 0.96B parameters, random init), 4 x 4096 tokens of data/sample per step, bf16, 20 steps each.
- `fp32_ref`: ZeRO-2 in fp32 (a JSON with bf16 and fp16 disabled) for the first 5 steps: the loss reference.
  Check: each ZeRO run's first 5 losses within LOSS_RTOL (2e-2 relative) of fp32's.
- the speed matrix, ZeRO-2, 10 steps (steady figures from step 6 on): `sdpa` is `zero2` itself;
  `sdpa_ckpt` (--gradient_checkpointing), `sdpa_compile` (--torch_compile), `flash` and `flash_ckpt`
  (--attn_implementation flash_attention_2, only where `flash_attn` imports; else the row says "not installed").
- `qlora` (with --qlora): the ~1B Llama saved as a pretrained folder (its random init, bf16), then `--use_peft
  --load_in_4bit --gradient_checkpointing` under ZeRO-3 in bf16 for 20 steps (bitsandbytes NF4 base, LoRA r 16 on
  every linear layer). Check: finite losses, and a peak GPU memory below the `zero3` run's (a 4-bit frozen base and
  an adapter's optimizer states against full training).
- `hf`: scripts/compare_hf_trainer.py --measure throughput --ranks 1 --precision bf16 on the same model, batch,
  ZeRO-2 and sdpa (one round: train.py, then the HF Trainer + DeepSpeed): steady tokens/s and the ratio.
- `dpo` (with --dpo): preference training of the ~1B Llama's saved weights (as `qlora`'s) under ZeRO-3,
  bf16, activation checkpointing, sigmoid loss, the reference's log-probs precomputed before step 1: --batch pairs
  per step, each pair's prompt about a quarter of the block and its completions an eighth (text of data/sample),
  20 steps. Check: step 1's loss is log 2 (the policy is its reference) within DPO_LOG2_ATOL; pairs/s (median
  step) beside the row's tokens/s (both sequences' tokens).
- `long_context` (with --long_context): scripts/bench/longest_block.py, the longest block of a Llama-8B-shaped
  model (4 of its layers, random init) that trains on the GPU with ZeRO-3 + CPU offload, activation checkpointing
  and offloading and the tiled MLP, doubled from 64K tokens until a run fails; its step time. Check: at least 1M
  tokens (the long-context goal). Minutes of attention at 1M tokens: run it as a command of its own.

tokens/s and MFU are the medians of the per-step metrics.jsonl records after the first steps (--warmup); peak
GPU GB is the largest `gpu_peak_gb` there (torch.cuda.max_memory_allocated, GiB, as --plan counts). Check: the
peak at most MEMORY_MARGIN (25%) above the plan's figure for the run's ZeRO stage and checkpointing.

Estimated GPU time (not yet measured on a GPU): each 1B run ~30-50 s (start-up, model init, 20 steps of ~0.3 s;
--no-save_at_end: no end-of-run checkpoint of ~14 GB), the default job ~40 s, the compiled run ~90 s, `hf` ~2
minutes: ~8 minutes without flash attention. `qlora` (~1 minute: saving the 1B weights, then the run) runs only with
--qlora, `dpo` (~1 minute, estimated: the reference pass over its pairs, then 20 steps) only with --dpo. `--skip`
trims it (e.g. `--skip sdpa_compile,default`); each row prints its seconds and the table the total.

Prints one Markdown table (run | what | steps | tokens/s | MFU | MFU causal/measured | peak GPU GB | planned GB |
check | status) and writes it as JSON (--json, default WORK_DIR/gpu_check.json). Exit code 1 if a run failed or a
check failed, 2 for a usage error.

The rows and what each runs: scripts/gpu_check_rows.py; running them: gpu_check_runs.py; the checks and the exit
code: gpu_check_checks.py; the machine's facts, the table and the JSON: gpu_check_report.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shlex
import sys
import tempfile
import time
from pathlib import Path

from scripts.compare_hf_trainer import build_model, common_env, model_shape, n_parameters
from scripts.gpu_check_checks import apply_checks, exit_code
from scripts.gpu_check_report import About, add_measured_mfu, causal_flops_per_token, header
from scripts.gpu_check_report import machine_facts, measured_peak, render, write_result
from scripts.gpu_check_rows import CPU_SETUP, GPU_SETUP, OK, Row, Setup, specs
from scripts.gpu_check_runs import Context, run_row

REPO = Path(__file__).resolve().parents[1]


def runs_to_skip(args: argparse.Namespace) -> list:
    """--skip's runs, and the rows that run only when asked for (their flag, or --only naming them): the default
    check keeps to its 8 minutes."""
    skip = [n for n in args.skip.split(",") if n]
    if not (args.qlora or "qlora" in args.only.split(",")):
        skip.append("qlora")  # its memory check compares with zero3: --only qlora,zero3
    if not (args.long_context or "long_context" in args.only.split(",")):
        skip.append("long_context")  # minutes of quadratic attention at 1M tokens
    if not (args.dpo or "dpo" in args.only.split(",")):
        skip.append("dpo")
    return skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cpu_test",
        action="store_true",
        help="run on a CPU: a tiny model, fp32, a few steps; flash attention and compile rows skipped",
    )
    p.add_argument("--work_dir", help="a new or empty folder for the runs (default: a new one under $TMPDIR)")
    p.add_argument("--only", default="", help="comma-separated run names to run (the others show as skipped)")
    p.add_argument("--skip", default="", help="comma-separated run names to leave out")
    p.add_argument(
        "--qlora",
        action="store_true",
        help="also run the qlora row (~1 minute more: the default check stays within its 8 minutes)",
    )
    p.add_argument(
        "--long_context",
        action="store_true",
        help="also run the long_context row (the longest block one GPU trains, doubling from 64K tokens: "
        "~10-15 minutes, run it as a command of its own: --only long_context --long_context)",
    )
    p.add_argument(
        "--dpo",
        action="store_true",
        help="also run the dpo row (preference training of the ~1B Llama, ~1 minute: not in the default 8 minutes)",
    )
    p.add_argument("--json", help="write the rows here (default: WORK_DIR/gpu_check.json)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    p.add_argument("--train_args", default="", help="extra flags for every train.py run (quoted, as one string)")
    return p.parse_args(argv)


def gpu_memory_gb(setup: Setup) -> float:
    """The GPU's memory, which --plan sizes for; on a CPU, an 80 GB card's."""
    if not setup.gpu:
        return 80.0
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def run_rows(all_specs: list, rows: dict, ctx: Context, selected: set, json_path: Path, about: About) -> tuple:
    """The selected rows in order, the JSON rewritten after each: (the plan's figures, the fp32 reference losses,
    the start time)."""
    planned, reference, started = {}, None, time.monotonic()
    for spec in all_specs:
        row = rows[spec.name]
        if spec.unavailable:
            row.status = spec.unavailable
            continue
        if spec.name not in selected:
            row.status = "skipped"
            continue
        print(f"gpu_check: {spec.name}: {spec.what} ... (log {row.log})", flush=True)
        t0 = time.monotonic()
        planned = run_row(spec, row, ctx) or planned
        if spec.name == "fp32_ref" and row.status == OK:
            reference = row.losses[: ctx.setup.ref_steps]
        row.seconds = time.monotonic() - t0
        print(
            f"gpu_check: {spec.name}: {row.status} in {row.seconds:.0f}s (total {time.monotonic() - started:.0f}s)",
            flush=True,
        )
        write_result(json_path, about, started, rows, planned, reference)
    return planned, reference, started


def main(argv=None) -> int:
    args = parse_args(argv)
    setup = CPU_SETUP if args.cpu_test else GPU_SETUP
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if work.exists() and any(work.iterdir()):
        print(
            f"error: --work_dir {work}: not empty; give a new or empty folder (runs there would resume)",
            file=sys.stderr,
        )
        return 2
    work.mkdir(parents=True, exist_ok=True)
    facts = machine_facts(work)
    facts["measured_matmul_tflops"] = round(measured_peak(setup), 2)
    print("gpu_check: machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
    flash = importlib.util.find_spec("flash_attn") is not None
    model = build_model(work / "model", argparse.Namespace(**dataclasses.asdict(setup)))
    all_specs = specs(setup, model, work, flash, tuple(shlex.split(args.train_args)))
    names = [s.name for s in all_specs]
    only = [n for n in args.only.split(",") if n]
    skip = runs_to_skip(args)
    unknown = sorted(set(only + skip) - set(names))
    if unknown:
        print(
            f"error: --only/--skip: unknown run(s) {', '.join(unknown)}; the runs are {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    ctx = Context(setup, work, common_env(work), model, args.timeout, gpu_memory_gb(setup))
    rows = {s.name: Row(s.name, s.what, log=str(work / f"{s.name}.log")) for s in all_specs}
    about = About(facts, setup, n_parameters(model_shape(setup), setup.heads, setup.kv_heads))
    json_path = Path(args.json) if args.json else work / "gpu_check.json"
    selected = {n for n in names if (not only or n in only) and n not in skip}
    planned, reference, started = run_rows(all_specs, rows, ctx, selected, json_path, about)
    apply_checks(rows, {s.name: s for s in all_specs}, planned, reference)
    add_measured_mfu(rows, causal_flops_per_token(model, setup), facts["measured_matmul_tflops"])
    print("\n" + render(rows, header(about, time.monotonic() - started, work)))
    write_result(json_path, about, started, rows, planned, reference)
    code = exit_code(rows)
    print(f"\nexit code {code}; rows in {json_path}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
