"""Host memory of the model build: the whole model on one rank against rank 0 of a PP 2 run (goal: at most 0.6x).

A 42M-parameter Llama (the tiny Llama widened: hidden 512, MLP 1408, 8 layers, vocabulary 16384), once pretrained
(random weights saved in bf16, as most checkpoints are, and built in fp32) and once from its config (random init,
fp32). Each figure is the `model build: host memory peak N MiB (+M MiB in it)` line of a `--dry_run` of train.py
(ZeRO-1), the +M part: how far the build raised the process's resident memory (rank 0's log).

    python scripts/bench/stage_build_memory.py
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from scripts.bench.common import bench_parser, launch

REPO = Path(__file__).resolve().parents[2]

WIDE = {
    "hidden_size": 512,
    "head_dim": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "vocab_size": 16384,
}
BUILD = re.compile(r"model build: host memory peak \d+ MiB \(\+(\d+) MiB in it\)")


def wide_models(folder: Path) -> tuple:
    """(pretrained folder with bf16 safetensors, config folder) of the wide model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from data.build_tiny_llama import tiny_llama_variant

    config_dir = tiny_llama_variant(folder / "config", **WIDE, dtype="float32")
    pretrained = tiny_llama_variant(folder / "pretrained", **WIDE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).to(torch.bfloat16).save_pretrained(
        pretrained
    )
    return pretrained, config_dir


def build_mib(model_flag: str, folder: Path, run_dir: Path, pp: int, block_size: int, batch: int) -> int:
    args = ["--config", "ds_configs/zero1.json", model_flag, str(folder), "--output_dir", str(run_dir), "--dry_run"]
    args += ["--block_size", str(block_size), "--per_device_train_batch_size", str(batch), "--disable_tqdm"]
    args += ["--gradient_accumulation_steps", str(pp)]  # a micro-batch per stage at least (fewer are refused)
    output = launch("train.py", [*args, "--pipeline_parallel_size", str(pp)], nprocs=pp)
    return int(BUILD.search(output).group(1))


def main() -> None:
    args = bench_parser(__doc__, block_size=64, batch=4).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pretrained, config_dir = wide_models(Path(tmp))
        print("| model | whole model, 1 rank (MiB) | rank 0 of PP 2 (MiB) | ratio |\n|---|---|---|---|")
        for label, flag, folder in (
            ("pretrained, bf16 safetensors", "--model_name_or_path", pretrained),
            ("random init (--config_name), fp32", "--config_name", config_dir),
        ):
            whole, stage = (
                build_mib(flag, folder, Path(tmp) / f"run{pp}", pp, args.block_size, args.batch) for pp in (1, 2)
            )
            print(f"| {label} | +{whole} | +{stage} | {stage / whole:.2f}x |")


if __name__ == "__main__":
    main()
