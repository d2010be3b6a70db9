"""The prepared GPU check (issue 13, item 8): one command, one H100/H200-class GPU, one table, exit non-zero on failure.

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
- `dpo` (with --dpo): preference training (issue 28) of the ~1B Llama's saved weights (as `qlora`'s) under ZeRO-3,
  bf16, activation checkpointing, sigmoid loss, the reference's log-probs precomputed before step 1: --batch pairs
  per step, each pair's prompt about a quarter of the block and its completions an eighth (text of data/sample),
  20 steps. Check: step 1's loss is log 2 (the policy is its reference) within DPO_LOG2_ATOL; pairs/s (median
  step) beside the row's tokens/s (both sequences' tokens).
- `long_context` (with --long_context): scripts/bench/longest_block.py, the longest block of a Llama-8B-shaped
  model (4 of its layers, random init) that trains on the GPU with ZeRO-3 + CPU offload, activation checkpointing
  and offloading and the tiled MLP, doubled from 64K tokens until a run fails; its step time. Check: at least 1M
  tokens (issue 27's goal). Minutes of attention at 1M tokens: run it as a command of its own.

tokens/s and MFU are the medians of the per-step metrics.jsonl records after the first steps (--warmup); peak
GPU GB is the largest `gpu_peak_gb` there (torch.cuda.max_memory_allocated, GiB, as --plan counts). Check: the
peak at most MEMORY_MARGIN (25%) above the plan's figure for the run's ZeRO stage and checkpointing.

Estimated GPU time (not yet measured on a GPU): each 1B run ~30-50 s (start-up, model init, 20 steps of ~0.3 s;
--no-save_at_end: no end-of-run checkpoint of ~14 GB), the default job ~40 s, the compiled run ~90 s, `hf` ~2
minutes: ~8 minutes without flash attention. `qlora` (~1 minute: saving the 1B weights, then the run) runs only with
--qlora, `dpo` (~1 minute, estimated: the reference pass over its pairs, then 20 steps) only with --dpo. `--skip`
trims it (e.g. `--skip sdpa_compile,default`); each row prints its seconds and the table the total.

Prints one Markdown table (run | what | steps | tokens/s | MFU | peak GPU GB | planned GB | check | status) and
writes it as JSON (--json, default WORK_DIR/gpu_check.json). Exit code 1 if a run failed or a check failed, 2 for
a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scaletrain.distributed.world import free_port  # noqa: E402
from scripts.compare_hf_trainer import build_model, common_env, model_shape, n_parameters  # noqa: E402
from scripts.bench.common import DEEPSPEED  # noqa: E402

LOSS_RTOL = 2e-2  # bf16 against fp32 over the first steps: bf16 rounds to ~3 significant digits
DPO_LOG2_ATOL = 1e-2  # step 1 of DPO: policy == reference up to bf16 rounding between the two forwards
MEMORY_MARGIN = 0.25  # the plan's working memory is an estimate; allocator slack and buffers come on top
OK, FAILED, CHECK_FAILED = "ok", "FAILED", "check failed"
PRETRAINED = "pretrained"  # the check's model with its random init saved as weights: what QLoRA and DPO start from
PAIRS = "pairs.jsonl"  # the dpo row's preference pairs


@dataclass(frozen=True)
class Setup:
    """The model, batch and run lengths of one mode (GPU, or --cpu_test)."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    vocab_size: int
    block_size: int
    batch: int
    zero_steps: int  # ZeRO-1/2/3 runs
    ref_steps: int  # the fp32 reference: the losses compared
    speed_steps: int  # the speed matrix and the HF comparison
    warmup: int  # steps left out of the steady figures
    precision: str  # of the ZeRO runs and the speed matrix
    gpu: bool
    learning_rate: float = 3e-4
    lr_warmup_steps: int = 5


GPU_SETUP = Setup(
    2048, 18, 16, 8, 32000, 4096, 4, zero_steps=20, ref_steps=5, speed_steps=10, warmup=5, precision="bf16", gpu=True
)
# This CPU's bf16 is ~100x slower than fp32: the CPU mode checks the program, not the numbers.
CPU_SETUP = Setup(
    64,
    2,
    4,
    2,
    4096,
    64,
    2,
    zero_steps=4,
    ref_steps=3,
    speed_steps=4,
    warmup=2,
    precision="fp32",
    gpu=False,
    learning_rate=1e-3,
    lr_warmup_steps=1,
)


@dataclass(frozen=True)
class Spec:
    """One run of the check."""

    name: str
    what: str
    kind: str  # "ops", "plan", "train" or "hf"
    args: tuple = ()
    steps: int | None = None
    plan_key: tuple | None = None  # (ZeRO stage, checkpointing) of the plan figure to hold the peak against
    unavailable: str | None = None  # why it cannot run here (the row's status)


@dataclass
class Row:
    run: str
    what: str
    steps: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gb: float | None = None
    planned_gb: float | None = None
    checks: list = field(default_factory=list)
    status: str = "not run"
    seconds: float | None = None
    losses: list = field(default_factory=list)
    log: str | None = None
    mfu_causal_measured: float | None = None  # tokens/s x causal model FLOPs / the card's measured matmul rate

    def fail_check(self, text: str) -> None:
        self.checks.append(text)
        if self.status == OK:
            self.status = CHECK_FAILED


# --- the runs ----------------------------------------------------------------------------------------------------


def specs(setup: Setup, model: Path, work: Path, flash: bool, extra: tuple) -> list:
    """Every run of the check, in order."""
    common = (
        "--config_name",
        str(model),
        "--block_size",
        str(setup.block_size),
        "--per_device_train_batch_size",
        str(setup.batch),
        "--per_device_eval_batch_size",
        str(setup.batch),
        "--max_eval_samples",
        "4",
        "--learning_rate",
        str(setup.learning_rate),
        "--warmup_steps",
        str(setup.lr_warmup_steps),
    )
    precision = ("--bf16",) if setup.precision == "bf16" else ()
    zero2 = ("--config", "ds_configs/zero2.json")
    gpu_only = None if setup.gpu else "needs a GPU"
    no_flash = gpu_only or (None if flash else "not installed (flash_attn does not import)")
    n = f"{n_parameters(model_shape(setup), setup.heads, setup.kv_heads) / 1e9:.2f}B"
    size = f"{n} Llama, {setup.batch} x {setup.block_size} tokens"

    def speed(name, what, flags, plan_key, unavailable=None):
        return Spec(
            name,
            f"speed: {what}, ZeRO-2, {setup.precision}, {size}",
            "train",
            (*zero2, *common, *precision, *flags),
            setup.speed_steps,
            plan_key,
            unavailable,
        )

    default_job = (
        ("--config", "ds_configs/zero3.json")
        + (("--bf16",) if setup.gpu else ())
        + (() if setup.gpu else ("--max_steps", "3"))
    )  # on a CPU a few steps of it show it runs
    runs = [
        Spec(
            "ops",
            "scripts/build_ops.py: FusedAdam built once, before the timed runs",
            "ops",
            unavailable=None if setup.gpu else "not needed on a CPU",
        ),
        Spec("plan", f"train.py --plan: {size}, {setup.precision}, 1 GPU", "plan", common),
        Spec(
            "default",
            "the default job (tiny Llama, data/sample)" + (", bf16" if setup.gpu else ", fp32 (CPU)"),
            "train",
            default_job,
        ),
        *[
            Spec(
                f"zero{stage}",
                f"ZeRO-{stage}, {setup.precision}, sdpa, {size}"
                + (" (also the speed matrix's sdpa row)" if stage == 2 else ""),
                "train",
                ("--config", f"ds_configs/zero{stage}.json", *common, *precision),
                setup.zero_steps,
                (stage, False),
            )
            for stage in (1, 2, 3)
        ],
        Spec(
            "fp32_ref",
            f"loss reference: ZeRO-2, fp32, activation checkpointing, {size}",
            "train",
            # Checkpointing changes no loss, and without it torch 2.11's fp32 attention for this model falls back
            # to a kernel that keeps ~4 GiB per layer: close to a whole H200.
            ("--config", str(fp32_config(work)), *common, "--gradient_checkpointing"),
            setup.ref_steps,
        ),
        speed("sdpa_ckpt", "sdpa + activation checkpointing", ("--gradient_checkpointing",), (2, True)),
        speed("sdpa_compile", "sdpa + torch.compile", ("--torch_compile",), (2, False), gpu_only),
        speed("flash", "flash_attention_2", ("--attn_implementation", "flash_attention_2"), (2, False), no_flash),
        speed(
            "flash_ckpt",
            "flash_attention_2 + activation checkpointing",
            ("--attn_implementation", "flash_attention_2", "--gradient_checkpointing"),
            (2, True),
            no_flash,
        ),
        Spec(
            "qlora",
            f"QLoRA: ZeRO-3, {setup.precision}, 4-bit base + LoRA r 16, activation checkpointing, {size}",
            "train",
            (
                "--config",
                "ds_configs/zero3.json",
                "--model_name_or_path",
                str(work / PRETRAINED),
                "--use_peft",
                "--load_in_4bit",
                "--gradient_checkpointing",
                *common[2:],
                *precision,
            ),
            setup.zero_steps,
            unavailable=gpu_only,
        ),
        Spec(
            "hf",
            f"HF Trainer + DeepSpeed, ZeRO-2, {setup.precision}, sdpa, {size} (compare_hf_trainer.py)",
            "hf",
            steps=setup.speed_steps,
        ),
        Spec(
            "dpo",
            f"DPO: ZeRO-3, {setup.precision}, sigmoid, reference precomputed, activation checkpointing, the {n} "
            f"Llama's weights, {setup.batch} pairs of up to {setup.block_size} tokens",
            "train",
            (
                "--config",
                "ds_configs/zero3.json",
                "--model_name_or_path",
                str(work / PRETRAINED),
                "--train_file",
                str(work / PAIRS),
                "--gradient_checkpointing",
                "--validation_split_percentage",
                "0",
                *common[2:],
                *precision,
            ),
            setup.zero_steps,
        ),
        Spec(
            "long_context",
            "longest block: Llama-8B shape (4 layers), ZeRO-3 + CPU offload, checkpointing + activation offloading "
            "+ tiled MLP, doubled from 64K tokens (scripts/bench/longest_block.py)",
            "longest",
        ),
    ]
    return [dataclasses.replace(s, args=(*s.args, *extra)) if s.kind == "train" else s for s in runs]


def save_pretrained_base(model: Path, folder: Path) -> None:
    """The check's model (a config and tokenizer folder) with seeded random weights, saved in bf16 as a pretrained
    folder: QLoRA adapts a pretrained model (--model_name_or_path), and no hub model can be assumed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model).save_pretrained(folder)


def write_pairs(path: Path, setup: Setup) -> None:
    """Preference pairs in TRL's explicit text format from data/sample's documents: pair i's prompt is a quarter of
    a block's worth of words of document i, its chosen and rejected completions an eighth of documents i + 1 and
    i + 2 (never the same text). As many pairs as the run's steps take (one epoch)."""
    if path.exists():
        return
    docs = [json.loads(line)["text"].split() for line in (REPO / "data" / "sample" / "train.jsonl").open()]
    docs = [d for d in docs if len(d) >= setup.block_size // 8]
    prompt_words, completion_words = setup.block_size // 4, setup.block_size // 8
    rows = []
    for i in range(setup.batch * setup.zero_steps):
        prompt, chosen, rejected = (docs[(3 * i + k) % len(docs)] for k in range(3))
        rows.append(
            {
                "prompt": " ".join(prompt[:prompt_words]),
                "chosen": " " + " ".join(chosen[:completion_words]),
                "rejected": " " + " ".join(rejected[:completion_words]),
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def dpo_check(row: Row, records: list) -> None:
    """Step 1's loss against log 2, and pairs/s (the median step's samples_per_s, which counts pairs)."""
    if row.losses:
        diff = abs(row.losses[0] - math.log(2))
        _record(row, diff <= DPO_LOG2_ATOL, f"step-1 loss {row.losses[0]:.4f} vs log 2: diff {diff:.1e}")
    pairs = [r["samples_per_s"] for r in records if "samples_per_s" in r]
    if pairs:
        row.checks.append(f"pairs/s {statistics.median(pairs):.2f} (median step)")


def fp32_config(work: Path) -> Path:
    """ds_configs/zero2.json with bf16 and fp16 disabled: "auto" picks bf16 on a GPU with bf16 support."""
    path = work / "zero2_fp32.json"
    if not path.exists():
        config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
        config["bf16"] = {"enabled": False}
        config["fp16"] = {**config.get("fp16", {}), "enabled": False}
        path.write_text(json.dumps(config, indent=2))
    return path


def launch(cmd: list, log: Path, env: dict, timeout: float) -> str | None:
    """Run `cmd` with its output in `log`; None when it exits 0, else why not."""
    with log.open("w") as out:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"ran past {timeout:.0f}s"
    return None if proc.returncode == 0 else f"exit {proc.returncode}"


def run_train(spec: Spec, setup: Setup, work: Path, env: dict, timeout: float, row: Row) -> None:
    out = work / spec.name
    cmd = [
        *DEEPSPEED,  # no launcher script assumed: a `pip install --target` puts none beside the interpreter
        "--num_gpus",
        "1",
        "--master_port",
        str(free_port()),
        "train.py",
        *spec.args,
        "--output_dir",
        str(out),
        "--logging_steps",
        "1",
        "--no-export_hf_at_end",
        "--no-save_at_end",
        "--disable_tqdm",
    ]
    if spec.steps and "--max_steps" not in spec.args:
        cmd += ["--max_steps", str(spec.steps)]
    problem = launch(cmd, Path(row.log), env, timeout)
    if problem:
        row.status, row.checks = FAILED, [f"{problem}; log {row.log}"]
        return
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    figures = train_figures(records, setup.warmup)
    row.steps, row.tokens_per_s, row.mfu, row.peak_gb, row.losses = (
        figures["steps"],
        figures["tokens_per_s"],
        figures["mfu"],
        figures["peak_gb"],
        figures["losses"],
    )
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


def run_hf(spec: Spec, setup: Setup, work: Path, env: dict, timeout: float, row: Row) -> float | None:
    """compare_hf_trainer.py's throughput measure on the check's model and batch; the train.py / HF ratio."""
    figures = work / "hf.json"
    cmd = [
        sys.executable,
        "scripts/compare_hf_trainer.py",
        "--measure",
        "throughput",
        "--ranks",
        "1",
        "--precision",
        setup.precision,
        "--zero_stage",
        "2",
        "--rounds",
        "1",
        "--hidden_size",
        str(setup.hidden_size),
        "--layers",
        str(setup.layers),
        "--heads",
        str(setup.heads),
        "--kv_heads",
        str(setup.kv_heads),
        "--vocab_size",
        str(setup.vocab_size),
        "--block_size",
        str(setup.block_size),
        "--batch",
        str(setup.batch),
        "--steps",
        str(spec.steps),
        "--warmup",
        str(setup.warmup),
        "--logging_steps",
        "1",
        "--learning_rate",
        str(setup.learning_rate),
        "--lr_warmup_steps",
        str(setup.lr_warmup_steps),
        "--max_rss_gb",
        "100",
        "--timeout",
        str(int(timeout)),
        "--work_dir",
        str(work / "hf"),
        "--json",
        str(figures),
    ]
    problem = launch(cmd, Path(row.log), env, timeout * 2 + 60)
    if problem:
        row.status, row.checks = FAILED, [f"{problem}; log {row.log}"]
        return None
    result = json.loads(figures.read_text())["throughput"]
    row.steps, row.status = spec.steps, OK
    row.tokens_per_s = result["median"]["hf_trainer"]["tokens_per_s"]
    ratio = result["ratio"]["tokens_per_s"]
    ours = result["median"]["train.py"]["tokens_per_s"]
    row.checks = [f"train.py / HF tokens/s = {ratio:.3f} (train.py {ours:.0f}, time stamps from step {setup.warmup})"]
    return ratio


LONG_CONTEXT_GOAL = 2**20  # tokens in one block on one H200 (issue 27; ALST: 500K on one H100-80GB)


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


# --- the checks ----------------------------------------------------------------------------------------------------


def loss_check(losses: list, reference: list, rtol: float = LOSS_RTOL) -> tuple:
    """(passed, text): the first len(reference) losses each within rtol (relative) of the reference's."""
    if len(losses) < len(reference) or not reference:
        return False, f"loss vs fp32: {len(losses)} losses against {len(reference)} reference losses"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[: len(reference)], reference, strict=True))
    passed = worst <= rtol
    return passed, (
        f"loss vs fp32, first {len(reference)} steps: max rel. diff {worst:.1e} {'<=' if passed else '>'} {rtol:g}"
    )


def memory_check(peak_gb: float | None, planned_gb: float | None, margin: float = MEMORY_MARGIN) -> tuple:
    """(passed, text): the measured peak at most `margin` above the plan; (True, '') when either is missing."""
    if peak_gb is None or planned_gb is None:
        return True, ""
    passed = peak_gb <= planned_gb * (1 + margin)
    return passed, (f"peak/plan {peak_gb / planned_gb:.2f} {'<=' if passed else '>'} {1 + margin:g}")


def apply_checks(rows: dict, specs_by_name: dict, planned: dict, reference: list | None) -> None:
    """The loss check on the ZeRO runs against fp32_ref, and the memory check on every run with a plan figure."""
    for name, row in rows.items():
        if row.status != OK:
            continue
        spec = specs_by_name[name]
        if name in ("zero1", "zero2", "zero3"):
            if reference is None:
                row.checks.append("loss vs fp32: no reference (fp32_ref did not run)")
            else:
                _record(row, *loss_check(row.losses, reference))
        if spec.plan_key and planned:
            row.planned_gb = planned.get(spec.plan_key)
            _record(row, *memory_check(row.peak_gb, row.planned_gb))
        if name == "qlora" and rows.get("zero3") is not None and rows["zero3"].status in (OK, CHECK_FAILED):
            _record(row, *qlora_memory_check(row.peak_gb, rows["zero3"].peak_gb))


def qlora_memory_check(qlora_gb: float | None, zero3_gb: float | None) -> tuple:
    """(passed, text): QLoRA's peak below the full ZeRO-3 run's on the same model and batch; (True, '') when either
    is missing (a CPU, or zero3 not run)."""
    if qlora_gb is None or zero3_gb is None:
        return True, ""
    passed = qlora_gb < zero3_gb
    return passed, f"peak vs zero3 {qlora_gb:.2f} {'<' if passed else '>='} {zero3_gb:.2f} GB"


def _record(row: Row, passed: bool, text: str) -> None:
    if not text:
        return
    if passed:
        row.checks.append(text)
    else:
        row.fail_check(text)


def exit_code(rows: dict) -> int:
    return 1 if any(row.status in (FAILED, CHECK_FAILED) for row in rows.values()) else 0


# --- the table -----------------------------------------------------------------------------------------------------


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def render(rows: dict, header: str) -> str:
    lines = [
        header,
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


# --- main ----------------------------------------------------------------------------------------------------------


def runs_to_skip(args: argparse.Namespace) -> list:
    """--skip's runs, and the qlora row unless asked for (--qlora, or --only naming it): the default check keeps to
    its 8 minutes."""
    skip = [n for n in args.skip.split(",") if n]
    if not (args.qlora or "qlora" in args.only.split(",")):
        skip.append("qlora")  # its memory check compares with zero3: --only qlora,zero3
    if not (args.long_context or "long_context" in args.only.split(",")):
        skip.append("long_context")  # minutes of quadratic attention at 1M tokens
    if not (args.dpo or "dpo" in args.only.split(",")):
        skip.append("dpo")  # ~1 minute: the default check keeps to its 8 minutes
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


def run_row(spec: Spec, row: Row, setup: Setup, work: Path, env: dict, args, model: Path, gpu_memory_gb: float):
    """One row of the check; the plan's figures for a `plan` row. Anything that stops a row from starting (a missing
    program, a folder that cannot be written) makes that row FAILED, with the reason: the next row still runs."""
    try:
        if spec.kind == "ops":
            run_ops(row, env, args.timeout)
        elif spec.kind == "plan":
            return run_plan(spec, env, args.timeout, row, gpu_memory_gb)
        elif spec.kind == "hf":
            run_hf(spec, setup, work, env, args.timeout, row)
        elif spec.kind == "longest":
            run_longest(setup, work, env, args.timeout, row)
        else:
            if "--model_name_or_path" in spec.args:  # qlora, dpo: they start from saved weights
                save_pretrained_base(model, work / PRETRAINED)
            if spec.name == "dpo":
                write_pairs(work / PAIRS, setup)
            run_train(spec, setup, work, env, args.timeout, row)
    except Exception as err:
        row.status, row.checks = FAILED, [f"could not run: {type(err).__name__}: {err}; log {row.log}"]
    return None


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


def write_result(path: Path, setup: Setup, n: int, started: float, rows: dict, planned: dict, reference, facts: dict):
    """The rows so far as JSON: written after every row, so a check cut short still leaves what it measured."""
    result = {
        "machine": facts,  # measured_matmul_tflops: the peak of the "MFU causal/measured" column
        "setup": dataclasses.asdict(setup),
        "parameters": n,
        "total_s": round(time.monotonic() - started, 1),
        "exit_code": exit_code(rows),
        "finished": all(row.status != "not run" for row in rows.values()),
        "planned_gb": {f"zero{k[0]}{'_ckpt' if k[1] else ''}": v for k, v in planned.items()},
        "loss_reference": reference,
        "rows": [dataclasses.asdict(r) for r in rows.values()],
    }
    path.write_text(json.dumps(result, indent=2))


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
    env = common_env(work)
    gpu_memory_gb = 80.0
    if setup.gpu:
        import torch

        gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    rows = {s.name: Row(s.name, s.what, log=str(work / f"{s.name}.log")) for s in all_specs}
    n = n_parameters(model_shape(setup), setup.heads, setup.kv_heads)
    json_path = Path(args.json) if args.json else work / "gpu_check.json"
    planned, reference, started = {}, None, time.monotonic()
    for spec in all_specs:
        row = rows[spec.name]
        if spec.unavailable:
            row.status = spec.unavailable
            continue
        if (only and spec.name not in only) or spec.name in skip:
            row.status = "skipped"
            continue
        print(f"gpu_check: {spec.name}: {spec.what} ... (log {row.log})", flush=True)
        t0 = time.monotonic()
        planned = run_row(spec, row, setup, work, env, args, model, gpu_memory_gb) or planned
        if spec.name == "fp32_ref" and row.status == OK:
            reference = row.losses[: setup.ref_steps]
        row.seconds = time.monotonic() - t0
        print(
            f"gpu_check: {spec.name}: {row.status} in {row.seconds:.0f}s (total {time.monotonic() - started:.0f}s)",
            flush=True,
        )
        write_result(json_path, setup, n, started, rows, planned, reference, facts)
    apply_checks(rows, {s.name: s for s in all_specs}, planned, reference)
    add_measured_mfu(rows, causal_flops_per_token(model, setup), facts["measured_matmul_tflops"])
    total = time.monotonic() - started
    header = (
        f"## GPU check ({'CPU test mode' if args.cpu_test else 'GPU'}): {n / 1e9:.2f}B-parameter Llama "
        f"(hidden {setup.hidden_size}, {setup.layers} layers, {setup.heads} heads / {setup.kv_heads} key/value,"
        f" vocab {setup.vocab_size}), {setup.batch} x {setup.block_size} tokens per step, 1 "
        f"{'GPU' if setup.gpu else 'CPU rank'}; loss tolerance {LOSS_RTOL:g} relative, memory margin "
        f"{MEMORY_MARGIN:.0%}; total {total:.0f}s; work dir {work} (each row's log: WORK_DIR/<run>.log). MFU: "
        f"PaLM's count (attention's whole T x T square) over the datasheet peak, as train.py logs it; beside it, "
        f"attention counted causally over the matrix-product rate measured on this device at the start "
        f"({facts['measured_matmul_tflops']:g} TFLOP/s), the figure peers (Megatron-LM, FlashAttention) report"
    )
    print("\n" + render(rows, header))
    write_result(json_path, setup, n, started, rows, planned, reference, facts)
    code = exit_code(rows)
    print(f"\nexit code {code}; rows in {json_path}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
