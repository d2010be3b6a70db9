"""The GPU check's rows: the model and batch of each mode, the row types, and what each row runs (its Spec).

scripts/gpu_check.py's docstring describes every row; scripts/gpu_check_runs.py runs them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from scripts.compare_hf_trainer import model_shape, n_parameters

REPO = Path(__file__).resolve().parents[1]

OK, FAILED, CHECK_FAILED = "ok", "FAILED", "check failed"
PRETRAINED = "pretrained"  # the check's model saved with its random init: QLoRA and DPO need saved weights
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
    kind: str  # "ops", "plan", "train", "hf" or "longest"
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


@dataclass(frozen=True)
class _Parts:
    """What several rows' train.py flags and descriptions share."""

    setup: Setup
    work: Path
    common: tuple  # the model, batch and learning-rate flags
    precision: tuple  # --bf16, or nothing for fp32
    n: str  # the parameter count in words, "0.96B"
    size: str  # the model and batch in words


def specs(setup: Setup, model: Path, work: Path, flash: bool, extra: tuple) -> list:
    """Every run of the check, in order; `extra` goes to every train.py run."""
    common = (
        *("--config_name", str(model), "--block_size", str(setup.block_size)),
        *("--per_device_train_batch_size", str(setup.batch), "--per_device_eval_batch_size", str(setup.batch)),
        *("--max_eval_samples", "4", "--learning_rate", str(setup.learning_rate)),
        *("--warmup_steps", str(setup.lr_warmup_steps)),
    )
    n = f"{n_parameters(model_shape(setup), setup.heads, setup.kv_heads) / 1e9:.2f}B"
    size = f"{n} Llama, {setup.batch} x {setup.block_size} tokens"
    parts = _Parts(setup, work, common, ("--bf16",) if setup.precision == "bf16" else (), n, size)
    runs = [
        Spec(
            "ops",
            "scripts/build_ops.py: FusedAdam built once, before the timed runs",
            "ops",
            unavailable=None if setup.gpu else "not needed on a CPU",
        ),
        Spec("plan", f"train.py --plan: {size}, {setup.precision}, 1 GPU", "plan", common),
        _default_job(setup),
        *(_zero(parts, stage) for stage in (1, 2, 3)),
        _fp32_reference(parts),
        *_speed_matrix(parts, flash),
        _qlora(parts),
        Spec(
            "hf",
            f"HF Trainer + DeepSpeed, ZeRO-2, {setup.precision}, sdpa, {size} (compare_hf_trainer.py)",
            "hf",
            steps=setup.speed_steps,
        ),
        _dpo(parts),
        Spec(
            "long_context",
            "longest block: Llama-8B shape (4 layers), ZeRO-3 + CPU offload, checkpointing + activation offloading "
            "+ tiled MLP, doubled from 64K tokens (scripts/bench/longest_block.py)",
            "longest",
        ),
    ]
    return [dataclasses.replace(s, args=(*s.args, *extra)) if s.kind == "train" else s for s in runs]


def _default_job(setup: Setup) -> Spec:
    """The README's default job; on a CPU a few steps of it show that it runs."""
    args = ("--config", "ds_configs/zero3.json") + (("--bf16",) if setup.gpu else ("--max_steps", "3"))
    what = "the default job (tiny Llama, data/sample)" + (", bf16" if setup.gpu else ", fp32 (CPU)")
    return Spec("default", what, "train", args)


def _zero(p: _Parts, stage: int) -> Spec:
    return Spec(
        f"zero{stage}",
        f"ZeRO-{stage}, {p.setup.precision}, sdpa, {p.size}"
        + (" (also the speed matrix's sdpa row)" if stage == 2 else ""),
        "train",
        ("--config", f"ds_configs/zero{stage}.json", *p.common, *p.precision),
        p.setup.zero_steps,
        (stage, False),
    )


def _fp32_reference(p: _Parts) -> Spec:
    return Spec(
        "fp32_ref",
        f"loss reference: ZeRO-2, fp32, activation checkpointing, {p.size}",
        "train",
        # Checkpointing changes no loss; without it torch 2.11's fp32 attention keeps ~4 GiB a layer: most of an H200.
        ("--config", str(fp32_config(p.work)), *p.common, "--gradient_checkpointing"),
        p.setup.ref_steps,
    )


def _speed_matrix(p: _Parts, flash: bool) -> list:
    """ZeRO-2's speed with checkpointing, compile and flash attention (`zero2` is its plain sdpa row)."""
    gpu_only = None if p.setup.gpu else "needs a GPU"
    no_flash = gpu_only or (None if flash else "not installed (flash_attn does not import)")
    flash_attn = ("--attn_implementation", "flash_attention_2")

    def speed(name, what, flags, plan_key, unavailable=None):
        return Spec(
            name,
            f"speed: {what}, ZeRO-2, {p.setup.precision}, {p.size}",
            "train",
            ("--config", "ds_configs/zero2.json", *p.common, *p.precision, *flags),
            p.setup.speed_steps,
            plan_key,
            unavailable,
        )

    return [
        speed("sdpa_ckpt", "sdpa + activation checkpointing", ("--gradient_checkpointing",), (2, True)),
        speed("sdpa_compile", "sdpa + torch.compile", ("--torch_compile",), (2, False), gpu_only),
        speed("flash", "flash_attention_2", flash_attn, (2, False), no_flash),
        speed(
            "flash_ckpt",
            "flash_attention_2 + activation checkpointing",
            (*flash_attn, "--gradient_checkpointing"),
            (2, True),
            no_flash,
        ),
    ]


def _from_pretrained(p: _Parts, flags: tuple) -> tuple:
    """ZeRO-3 from the saved weights (no --config_name), with the common batch flags."""
    model = ("--model_name_or_path", str(p.work / PRETRAINED))
    return ("--config", "ds_configs/zero3.json", *model, *flags, *p.common[2:], *p.precision)


def _qlora(p: _Parts) -> Spec:
    return Spec(
        "qlora",
        f"QLoRA: ZeRO-3, {p.setup.precision}, 4-bit base + LoRA r 16, activation checkpointing, {p.size}",
        "train",
        _from_pretrained(p, ("--use_peft", "--load_in_4bit", "--gradient_checkpointing")),
        p.setup.zero_steps,
        unavailable=None if p.setup.gpu else "needs a GPU",
    )


def _dpo(p: _Parts) -> Spec:
    flags = ("--train_file", str(p.work / PAIRS), "--gradient_checkpointing", "--validation_split_percentage", "0")
    return Spec(
        "dpo",
        f"DPO: ZeRO-3, {p.setup.precision}, sigmoid, reference precomputed, activation checkpointing, the {p.n} "
        f"Llama's weights, {p.setup.batch} pairs of up to {p.setup.block_size} tokens",
        "train",
        _from_pretrained(p, flags),
        p.setup.zero_steps,
    )


def fp32_config(work: Path) -> Path:
    """ds_configs/zero2.json with bf16 and fp16 disabled: "auto" picks bf16 on a GPU with bf16 support."""
    path = work / "zero2_fp32.json"
    if not path.exists():
        config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
        config["bf16"] = {"enabled": False}
        config["fp16"] = {**config.get("fp16", {}), "enabled": False}
        path.write_text(json.dumps(config, indent=2))
    return path


def save_pretrained_base(model: Path, folder: Path) -> None:
    """The check's model with seeded random weights, saved in bf16 as a pretrained folder: no hub model can be
    assumed, and QLoRA adapts a pretrained model (--model_name_or_path)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model).save_pretrained(folder)


def write_pairs(path: Path, setup: Setup) -> None:
    """Preference pairs in TRL's explicit text format from data/sample's documents, as many as the run's steps take
    (one epoch): pair i's prompt is a quarter of a block's worth of words of document i, its chosen and rejected
    completions an eighth of documents i + 1 and i + 2 (never the same text)."""
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
