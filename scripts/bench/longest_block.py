"""The longest block one GPU trains: a Llama-8B-shaped model (random init) with every memory feature on, the block
doubled from --start tokens until a run fails (out of memory) or --max_tokens is reached.

Each length is one train.py run of --steps optimizer steps on one rank: ZeRO-3 with the optimizer and the weights
offloaded to the CPU (ds_configs/zero3_offload.json), --gradient_checkpointing --activation_offloading --tiled_mlp,
the chunked loss (the default), bf16 on a GPU (fp32 on a CPU), micro-batch 1, the data a corpus of the sample text
repeated until it holds the longest block asked for. The step time is the last step's.

    python scripts/bench/longest_block.py                  # Llama-8B shape, 4 of its 32 layers, 64K, 128K, ...
    python scripts/bench/longest_block.py --layers 32 --max_tokens 524288
    python scripts/bench/longest_block.py --cpu_test       # the program on a CPU: a tiny model, 256 and 512 tokens

Attention is quadratic: a step of a 1M-token block of the 32-layer model takes tens of minutes on one H200, so the
default keeps 4 layers (each layer's working memory is the same; the offloaded checkpoints and the model states
grow with the layers, and live in host memory). Prints one line per length and a JSON line at the end:
{"longest_tokens": N, "step_s": S, "tokens_per_s": ..., "attempts": [...]}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from scaletrain.observability.metrics import METRICS_FILE, read_records
from scripts.launching import Launcher, child_env, run

REPO = Path(__file__).resolve().parents[2]

LLAMA_8B = {  # Llama-3.1-8B's shape; the vocabulary is the sample tokenizer's (random init, our own data)
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
TINY = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
FEATURES = ["--gradient_checkpointing", "--activation_offloading", "--tiled_mlp"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the Llama-8B shape (default 4 of 32)")
    p.add_argument("--start", type=int, default=65536, help="the first block length (tokens)")
    p.add_argument("--max_tokens", type=int, default=2**21, help="stop doubling here")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per length (the last one is timed)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per length before it counts as failed")
    p.add_argument("--cpu_test", action="store_true", help="a tiny model, fp32, 256 and 512 tokens")
    p.add_argument("--work_dir", help="folder for the runs (default: a new temporary one)")
    args = p.parse_args(argv)
    if args.cpu_test:
        args.start, args.max_tokens, args.layers = min(args.start, 256), min(args.max_tokens, 512), 2
    return args


def model_folder(folder: Path, layers: int, longest: int, shape: dict) -> Path:
    from data.build_tiny_llama import tiny_llama_variant

    return tiny_llama_variant(folder, num_hidden_layers=layers, max_position_embeddings=longest, **shape)


def corpus(folder: Path, tokens: int) -> Path:
    """The sample corpus repeated until it holds about `tokens` tokens (4 characters a token, rounded up)."""
    text = (REPO / "data" / "sample" / "train.jsonl").read_text()
    path = folder / "train.jsonl"
    path.write_text(text * max(1, -(-tokens * 4 // len(text)) + 1))
    return path


def attempt(tokens: int, model: Path, data: Path, run_dir: Path, args) -> dict:
    """One run at `tokens` tokens: {"tokens", "ok", "step_s", "peak_gb", "why"}."""
    cmd = Launcher("deepspeed", 1).command("train.py", [
        "--config", "ds_configs/zero3_offload.json",
        "--config_name", str(model), "--train_file", str(data), "--validation_split_percentage", "0",
        "--block_size", str(tokens), "--per_device_train_batch_size", "1", "--max_steps", str(args.steps),
        "--logging_steps", "1", "--no-save_at_end", "--no-export_hf_at_end", "--disable_tqdm",
        "--output_dir", str(run_dir), *FEATURES, *([] if args.cpu_test else ["--bf16"]),
    ])  # fmt: skip
    started = time.monotonic()
    log = run_dir.with_suffix(".log")
    try:
        proc = run(cmd, child_env(), timeout=args.timeout, log=log)
        why = None if proc.returncode == 0 else f"exit {proc.returncode} (log {log})"
    except subprocess.TimeoutExpired:
        why = f"ran past {args.timeout:.0f}s (log {log})"
    result = {"tokens": tokens, "ok": why is None, "why": why, "run_s": round(time.monotonic() - started, 1)}
    if why is None:
        records, _ = read_records(run_dir / METRICS_FILE)
        steps = [r for r in records if "loss" in r]
        times = [r["time"] for r in steps]
        result["step_s"] = round(times[-1] - times[-2], 2) if len(times) > 1 else None
        result["peak_gb"] = max((r["gpu_peak_gb"] for r in steps if r.get("gpu_peak_gb")), default=None)
        result["loss"] = steps[-1]["loss"]
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="longest_block_"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_folder(work / "model", args.layers, args.max_tokens, TINY if args.cpu_test else LLAMA_8B)
    data = corpus(work, args.max_tokens * (args.steps + 1))
    attempts, tokens = [], args.start
    while tokens <= args.max_tokens:
        result = attempt(tokens, model, data, work / f"run_{tokens}", args)
        attempts.append(result)
        figures = f", step {result['step_s']} s, peak {result['peak_gb']} GB" if result["ok"] else ""
        print(f"longest_block: {tokens} tokens: {'ok' if result['ok'] else result['why']}{figures}", flush=True)
        if not result["ok"]:
            break
        tokens *= 2
    trained = [a for a in attempts if a["ok"]]
    best = trained[-1] if trained else None
    summary = {
        "layers": args.layers,
        "longest_tokens": best["tokens"] if best else 0,
        "step_s": best and best["step_s"],
        "tokens_per_s": best and best["step_s"] and round(best["tokens"] / best["step_s"], 1),
        "stopped_by": attempts[-1]["why"] if attempts and not attempts[-1]["ok"] else "--max_tokens",
        "attempts": attempts,
    }
    print(json.dumps(summary))
    return 0 if best else 1


if __name__ == "__main__":
    raise SystemExit(main())
