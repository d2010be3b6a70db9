"""Peak memory of one rank at long sequences, with and without each long-context feature, against the Hugging Face
Trainer + DeepSpeed with gradient checkpointing on the same model and blocks.

The model is a Llama with a wide MLP (hidden 256, MLP 4096, 2 layers, 4 heads, 2 KV heads), trained from scratch in
fp32 under ZeRO-2 for --steps steps on one block per micro-batch of the sample corpus. Each run is its own process
tree; its peak is the largest resident set of any process in it (getrusage of the reaped children, so one rank's
peak). What a block of T tokens costs is reported as the peak at T minus the peak at the first --blocks length
(512), so the model, the optimizer and the libraries cancel out.

    python scripts/bench/long_context_memory.py                      # 512, 16384 and 32768 tokens
    python scripts/bench/long_context_memory.py --blocks 512,16384 --sp_block 16384

Variants on one rank: gradient checkpointing alone, + --tiled_mlp, + --activation_offloading, both, and both with the
loss in chunks of 1024 tokens (--loss_chunk_size: the auto chunk holds 16K tokens of this small vocabulary); the
Trainer with gradient checkpointing (scripts/bench/hf_trainer_clm.py). Under sequence parallelism 2 (two ranks, one
block of --sp_block tokens with several documents in it): with and without --attention_isolation.

On a CPU, activation offloading moves nothing off the device (host memory is the device): it runs its copy path and
its figure shows what that copy costs, not what it saves on a GPU.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from scripts.bench.common import bench_parser, train_args
from scripts.launching import Launcher, child_env, run

REPO = Path(__file__).resolve().parents[2]

VARIANTS = {  # name -> train.py flags on top of gradient checkpointing
    "checkpointing": [],
    "+ tiled MLP": ["--tiled_mlp"],
    "+ activation offloading": ["--activation_offloading"],
    "+ tiled MLP + offloading": ["--tiled_mlp", "--activation_offloading"],
    # the auto loss chunk (256 MiB of fp32 logits) is 16K tokens of this 4096-word vocabulary: no chunking at 16K
    "+ tiled MLP + offloading + loss chunks of 1024": [
        "--tiled_mlp",
        "--activation_offloading",
        "--loss_chunk_size",
        "1024",
    ],  # fmt: skip
}
EVERY_FEATURE = "+ tiled MLP + offloading + loss chunks of 1024"
TRAINER = "Trainer + DeepSpeed, checkpointing"


def wide_llama(folder: Path, longest: int) -> Path:
    from data.build_tiny_llama import tiny_llama_variant

    return tiny_llama_variant(
        folder, hidden_size=256, intermediate_size=4096, num_hidden_layers=2, head_dim=64,
        max_position_embeddings=longest,
    )  # fmt: skip


def peak_mib(cmd: list) -> float:
    """The largest resident set (MiB) of any process of `cmd`'s tree, from a fresh Python that runs it."""
    probe = (
        "import resource, subprocess, sys\n"
        "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "if proc.returncode:\n"
        "    sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    proc = run([sys.executable, "-c", probe, *cmd], child_env())
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{proc.stderr[-4000:]}")
    return int(proc.stdout.split()[-1]) / 2**10  # KiB


def train_cmd(model: Path, run_dir: Path, block: int, steps: int, nprocs: int, flags: list) -> list:
    args = train_args(REPO / "ds_configs" / "zero2.json", model, run_dir, steps, block, 1, "--gradient_checkpointing")
    return Launcher("deepspeed", nprocs).command("train.py", [*args, "--save_steps", "0", *flags])


def trainer_cmd(model: Path, run_dir: Path, block: int, steps: int) -> list:
    """The Trainer on the transformers docs' ZeRO-2 config (as scripts/compare_hf_trainer.py runs it)."""
    from scripts.compare_hf_trainer import hf_ds_config

    train = str(REPO / "data" / "sample" / "train.jsonl")
    run_dir.mkdir(parents=True)
    (run_dir / "ds.json").write_text(json.dumps(hf_ds_config(2)))
    return Launcher("deepspeed", 1).command("scripts/bench/hf_trainer_clm.py", [
        "--config_name", str(model),
        "--deepspeed", str(run_dir / "ds.json"), "--output_dir", str(run_dir),
        "--block_size", str(block), "--per_device_train_batch_size", "1", "--per_device_eval_batch_size", "1",
        "--max_eval_samples", "1", "--validation_file", train, "--max_steps", str(steps), "--eval_steps",
        str(steps), "--gradient_checkpointing",
    ])  # fmt: skip


def main() -> None:
    parser = bench_parser(__doc__, steps=2)
    parser.add_argument("--blocks", default="512,16384,32768", help="block lengths; the first is the baseline")
    parser.add_argument("--sp_block", type=int, default=16384, help="block of the sequence-parallel pair (0: none)")
    parser.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    parser.add_argument("--no_trainer", action="store_true", help="leave out the Trainer runs")
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    variants = {n: f for n, f in VARIANTS.items() if not args.variants or n in args.variants.split(",")}
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = wide_llama(Path(tmp) / "model", max(blocks + [args.sp_block]))
        for block in blocks:
            for name, flags in variants.items():
                run = Path(tmp) / f"{len(results)}"
                results[(name, block)] = peak_mib(train_cmd(model, run, block, args.steps, 1, flags))
                print(f"{name:32s} {block:6d} tokens: peak {results[(name, block)]:8.0f} MiB", flush=True)
            if not args.no_trainer:
                run = Path(tmp) / f"{len(results)}"
                results[(TRAINER, block)] = peak_mib(trainer_cmd(model, run, block, args.steps))
                print(f"{TRAINER:32s} {block:6d} tokens: peak {results[(TRAINER, block)]:8.0f} MiB", flush=True)
        sp = {}
        if args.sp_block:
            for isolation in (False, True):
                run = Path(tmp) / f"sp{isolation}"
                flags = ["--sequence_parallel_size", "2"] + (["--attention_isolation"] if isolation else [])
                sp[isolation] = peak_mib(train_cmd(model, run, args.sp_block, args.steps, 2, flags))
                print(f"SP 2, isolation {isolation}: peak {sp[isolation]:.0f} MiB", flush=True)
    base = blocks[0]
    print(f"\n| variant | peak at {base} (MiB) | " + " | ".join(f"peak at {b} / added over {base}" for b in blocks[1:]))
    print("|---|---|" + "---|" * (len(blocks) - 1))
    for name in [*variants, *([] if args.no_trainer else [TRAINER])]:
        cells = [f"{results[(name, b)]:.0f} / +{results[(name, b)] - results[(name, base)]:.0f}" for b in blocks[1:]]
        print(f"| {name} | {results[(name, base)]:.0f} | " + " | ".join(cells) + " |")
    for b in blocks[1:] if EVERY_FEATURE in variants and not args.no_trainer else []:
        ours = results[(EVERY_FEATURE, b)] - results[(EVERY_FEATURE, base)]
        theirs = results[(TRAINER, b)] - results[(TRAINER, base)]
        print(f"added at {b}: train.py with every feature / the Trainer = {ours / theirs:.2f}")
    if sp:
        print(f"SP 2 at {args.sp_block}: isolation / no isolation peak = {sp[True] / sp[False]:.3f}")
    print(json.dumps({"results": {f"{k[0]}@{k[1]}": v for k, v in results.items()}, "sp": sp}))


if __name__ == "__main__":
    main()
