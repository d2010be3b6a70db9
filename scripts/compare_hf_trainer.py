"""train.py against the Hugging Face Trainer + DeepSpeed on the same job: peak memory and steady tokens/s.

Both sides get the same model config folder (random init from the same seed), the same data (data/sample, train
and validation files, packed into blocks of --block_size), the same global batch, peak learning rate, LR warmup,
ZeRO stage, precision and number of ranks, both launched with the `deepspeed` launcher, alternating, --rounds
times each; medians are reported, with the ratio train.py / HF Trainer.

- train.py: `deepspeed --num_gpus R train.py --config ds_configs/zeroS.json --config_name MODEL ...` (its own
  packing: documents joined with EOS; no end-of-run checkpoint or HF export, as the HF side saves nothing).
- HF: `deepspeed --num_gpus R scripts/bench/hf_trainer_clm.py --deepspeed ds.json ...` (run_clm's recipe: tokenize,
  group_texts, labels = input_ids; Trainer with the transformers docs' ZeRO config, "auto" values filled by the
  Trainer, without the docs' optimizer offload and with the Trainer's own cosine schedule instead of a
  "scheduler" section; on a CPU `torch_adam` as train.py does, so neither side builds FusedAdam, and accelerate's
  backend choice patched so that it sees the launcher's ranks: see hf_trainer_clm.py).
- Evaluation: both evaluate every --eval_steps (default: once, at the last step) over the first --eval_samples
  validation blocks, --batch per rank.

Figures:
- peak memory: GNU time's maximum RSS (`/usr/bin/time -f %M`) of the launcher's process tree (the largest single
  process: on one rank, that rank), evaluation included. The tree's summed RSS, sampled every 0.1 s, is in the
  JSON too; a run whose tree passes --max_rss_gb (default 20), or that leaves the machine under 1 GiB available,
  is stopped and reported as such.
- steady tokens/s: whole blocks per step (batch x ranks x block) between the end of step --warmup and the last
  step, over the wall-clock time between them (train.py: the `time` stamps of its metrics.jsonl, every
  --logging_steps; HF: a callback's stamp at every step end), as scripts/bench/overhead.py computes it. Each side
  also reports the input tokens and target labels it trained per step; the run fails unless they agree (the
  targets up to train.py's padding: it pads an epoch's last partial block, which group_texts drops).

    python scripts/compare_hf_trainer.py --measure memory       # 1 rank, hidden 64, 2 layers, vocab 128,256,
                                                                # 4 x 2048 tokens per step, 6 steps
    python scripts/compare_hf_trainer.py --measure throughput   # 2 ranks, the 5.0M-parameter Llama of
                                                                # scripts/bench/overhead.py, 4 x 256 tokens per rank,
                                                                # 60 steps
    python scripts/compare_hf_trainer.py --measure both --json figures.json

One round of --measure memory takes about 5 minutes on 2 cores (two runs of ~13 GiB: 4 x 2048 x 128,256 fp32
logits are 3.9 GiB), one of --measure throughput about 2 minutes.

Prints one Markdown row per figure (figure | train.py | HF Trainer + DeepSpeed | ratio) and a JSON line; exits
non-zero if a run fails (printing its command and the tail of its output). On a CPU this is fp32 on however many
cores there are (2 here): both sides run DeepSpeed's CPU accelerator with gloo, torch AdamW, no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from data.build_tiny_llama import tiny_llama_variant
from scaletrain.observability.metrics import METRICS_FILE, read_records
from scripts.bench.common import bench_model, steady_rate
from scripts.launching import Launcher, child_env

REPO = Path(__file__).resolve().parents[1]

TINY_VOCAB = 4096  # data/tiny-llama's tokenizer; a larger model vocabulary simply has unused rows
# Per-measure defaults: the jobs the memory and throughput goals are measured on; command-line flags override them.
SETUPS = {
    "memory": dict(
        ranks=1,
        hidden_size=64,
        layers=2,
        vocab_size=128256,
        block_size=2048,
        batch=4,
        steps=6,
        warmup=2,
        logging_steps=2,
        heads=4,
        kv_heads=2,
    ),
    "throughput": dict(
        ranks=2,
        hidden_size=256,
        layers=4,
        vocab_size=TINY_VOCAB,
        block_size=256,
        batch=4,
        steps=60,
        warmup=10,
        logging_steps=10,
        heads=4,
        kv_heads=2,
    ),
}
GIB = 1024**3


class RunFailed(Exception):
    pass


# --- the model and the HF side's DeepSpeed config ---------------------------------------------------------------


def model_shape(s: argparse.Namespace) -> dict:
    """Config values of the model: data/tiny-llama's (4 heads, 2 key/value heads; --heads, --kv_heads) widened to
    --hidden_size, MLP width 8/3 x hidden rounded to a multiple of 16 (688 at 256: bench/overhead.py's Llama)."""
    return dict(
        hidden_size=s.hidden_size,
        intermediate_size=round(s.hidden_size * 8 / 3 / 16) * 16,
        head_dim=s.hidden_size // s.heads,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        num_hidden_layers=s.layers,
        vocab_size=s.vocab_size,
        max_position_embeddings=max(256, s.block_size),
    )


def n_parameters(shape: dict, heads: int = 4, kv_heads: int = 2) -> int:
    """Parameters of the untied Llama of `shape` (embedding + head + layers + final norm)."""
    h, f, d, v = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"], shape["vocab_size"]
    layer = h * heads * d * 2 + h * kv_heads * d * 2 + 3 * h * f + 2 * h
    return 2 * v * h + shape["num_hidden_layers"] * layer + h


def build_model(folder: Path, s: argparse.Namespace) -> Path:
    shape = model_shape(s)
    if (s.hidden_size, s.layers, s.vocab_size, s.block_size, s.heads, s.kv_heads) == (256, 4, TINY_VOCAB, 256, 4, 2):
        return bench_model(folder)  # the overhead benchmark's Llama, as it is
    return tiny_llama_variant(folder, **shape)


def hf_ds_config(stage: int) -> dict:
    """The transformers docs' ZeRO-2 (or ZeRO-3) example config, "auto" where the Trainer decides; without the
    example's optimizer offload (train.py's zeroS.json has none) and without its "scheduler" section (the Trainer
    then runs its own --lr_scheduler_type, as train.py does)."""
    if stage == 3:
        zero = {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    else:
        zero = {
            "stage": stage,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "contiguous_gradients": True,
        }
    return {
        "fp16": {
            "enabled": "auto",
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


# --- launching, with GNU time and a memory guard ---------------------------------------------------------------


GNU_TIME = "/usr/bin/time"  # optional: where an image lacks it, the largest process's sampled RSS stands in


def _tree_rss(proc: psutil.Process) -> tuple:
    """(the process tree's total RSS, its largest single process's), in bytes."""
    sizes = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            sizes.append(p.memory_info().rss)
        except psutil.Error:
            pass  # ended in between
    return sum(sizes), max(sizes, default=0)


def launch(script: str, args: list, s: argparse.Namespace, env: dict, log: Path) -> dict:
    """Run `script` under `/usr/bin/time -f %M deepspeed --num_gpus R`; {"max_rss_kb", "tree_peak_rss_kb"}.
    Without GNU time, max_rss_kb is the largest single process's RSS sampled every 0.1 s (max_rss_source says
    which). Raises RunFailed with the command and its output's tail when it fails or outgrows the memory guard."""
    time_file = log.with_suffix(".maxrss")
    gnu_time = [GNU_TIME, "-f", "%M", "-o", str(time_file)] if Path(GNU_TIME).is_file() else []
    # a free --master_port: another job on the machine may hold the launcher's default port
    cmd = [*gnu_time, *Launcher("deepspeed", s.ranks).command(script, args)]
    limit = s.max_rss_gb * GIB
    load_before, started = round(os.getloadavg()[0], 2), time.monotonic()  # another job on the machine shows here
    peak, single_peak, stopped = 0, 0, None
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        watched = psutil.Process(proc.pid)
        deadline = time.monotonic() + s.timeout
        try:
            while proc.poll() is None:
                rss, largest = _tree_rss(watched)
                peak, single_peak = max(peak, rss), max(single_peak, largest)
                if rss > limit:
                    stopped = f"its process tree passed --max_rss_gb {s.max_rss_gb:g} ({rss / GIB:.1f} GiB)"
                elif psutil.virtual_memory().available < GIB:
                    stopped = f"the machine had under 1 GiB available (tree at {rss / GIB:.1f} GiB)"
                elif time.monotonic() > deadline:
                    stopped = f"it ran past --timeout {s.timeout}s"
                if stopped:
                    break
                time.sleep(0.1)
        finally:
            if stopped or proc.poll() is None:  # stopped here, or this script interrupted: end what it started
                os.killpg(proc.pid, signal.SIGKILL)  # the session of the launch: the launcher and its ranks
                proc.wait()
    tail = log.read_text(errors="replace")[-4000:]
    if stopped or proc.returncode != 0:
        why = f"stopped: {stopped}" if stopped else f"exit {proc.returncode}"
        raise RunFailed(f"{' '.join(cmd)}\n{why}; tree peak {peak / GIB:.2f} GiB; log {log}, its tail:\n{tail}")
    return {
        "max_rss_kb": int(time_file.read_text().split()[-1]) if gnu_time else single_peak // 1024,
        "max_rss_source": "GNU time" if gnu_time else "sampled (no /usr/bin/time)",
        "tree_peak_rss_kb": peak // 1024,
        "wall_s": round(time.monotonic() - started, 1),
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
    }


def common_env(tmp: Path) -> dict:
    """Both sides' environment: offline, the repository first on PYTHONPATH and the caller's kept (packages carried
    with --target), the caches under `tmp` (each side tokenizes in its first round)."""
    return child_env(tmp)


# --- one run of each side ----------------------------------------------------------------------------------------


def shared_flags(s: argparse.Namespace) -> list:
    """The flags both programs take with the same spelling and meaning (hf_trainer_clm.py mirrors train.py's)."""
    return [
        "--block_size",
        str(s.block_size),
        "--per_device_train_batch_size",
        str(s.batch),
        "--per_device_eval_batch_size",
        str(s.batch),
        "--max_eval_samples",
        str(s.eval_samples),
        "--max_steps",
        str(s.steps),
        "--eval_steps",
        str(s.eval_steps),
        "--logging_steps",
        str(s.logging_steps),
        "--learning_rate",
        str(s.learning_rate),
        "--warmup_steps",
        str(s.lr_warmup_steps),
        "--seed",
        str(s.seed),
        "--attn_implementation",
        s.attn_implementation,
        *(["--bf16"] if s.precision == "bf16" else []),
    ]


def run_ours(model: Path, run_dir: Path, s: argparse.Namespace, env: dict) -> dict:
    args = [
        "--config",
        f"ds_configs/zero{s.zero_stage}.json",
        "--config_name",
        str(model),
        "--output_dir",
        str(run_dir),
        *shared_flags(s),
        "--no-export_hf_at_end",
        "--no-save_at_end",  # the HF side saves nothing either
        "--disable_tqdm",
        *s.ours_flags.split(),
    ]
    mem = launch("train.py", args, s, env, run_dir.with_suffix(".log"))
    records, _ = read_records(run_dir / METRICS_FILE)
    train = [r for r in records if "loss" in r]
    steps = [r["step"] for r in train]
    blocks = {r["global_batch"] for r in train}
    if len(blocks) != 1:
        raise RunFailed(f"train.py's global batch changed during the run: {sorted(blocks)}")
    return {
        **mem,
        "tokens_per_s": steady_rate(steps, [r["time"] for r in train], s.tokens_per_step, s.warmup),
        "input_tokens_per_step": blocks.pop() * s.block_size,
        "targets_per_step": train[-1]["tokens_seen"] / steps[-1],  # over the whole run, as the HF side counts
        "epochs_touched": math.ceil(train[-1]["epoch"]),
        "eval_losses": [r["eval_loss"] for r in records if "eval_loss" in r],
    }


def run_hf(model: Path, ds_config: Path, run_dir: Path, s: argparse.Namespace, env: dict) -> dict:
    args = ["--config_name", str(model), "--deepspeed", str(ds_config), "--output_dir", str(run_dir), *shared_flags(s)]
    mem = launch("scripts/bench/hf_trainer_clm.py", args, s, env, run_dir.with_suffix(".log"))
    result = json.loads((run_dir / "hf_steps.json").read_text())
    ran = result["deepspeed"] or {}
    expected = {
        "zero_stage": s.zero_stage,
        "world_size": s.ranks,
        "precision": s.precision,
        "train_batch_size": s.batch * s.ranks,
    }
    if {k: ran.get(k) for k in expected} != expected:
        raise RunFailed(
            f"the HF Trainer did not run the DeepSpeed job asked for: {ran or 'no DeepSpeed engine'}, "
            f"expected {expected}; log {run_dir.with_suffix('.log')}"
        )
    return {
        **mem,
        "tokens_per_s": steady_rate(result["steps"], result["times"], s.tokens_per_step, s.warmup),
        "input_tokens_per_step": result["input_tokens_per_step"],
        "targets_per_step": result["targets_per_step"],
        "eval_losses": result["eval_losses"],
        "eval_blocks": result["eval_blocks"],
        "world_size": result["world_size"],
        "deepspeed": ran,
    }


# --- one measure -------------------------------------------------------------------------------------------------


def settings(measure: str, cli: argparse.Namespace) -> argparse.Namespace:
    """The measure's defaults, overridden by what was typed."""
    s = argparse.Namespace(**{**SETUPS[measure], **{k: v for k, v in vars(cli).items() if v is not None}})
    s.eval_steps = s.eval_steps or s.steps
    s.tokens_per_step = s.batch * s.ranks * s.block_size
    problems = (
        [
            f"--warmup {s.warmup} and --steps {s.steps} must be multiples of --logging_steps "
            f"{s.logging_steps} (train.py stamps a time every --logging_steps)"
        ]
        if s.warmup % s.logging_steps or s.steps % s.logging_steps
        else []
    )
    if not 0 < s.warmup < s.steps:
        problems.append(f"--warmup {s.warmup}: must be between 0 and --steps {s.steps}")
    if s.steps % s.eval_steps:
        problems.append(f"--eval_steps {s.eval_steps} must divide --steps {s.steps} (an evaluation at the end)")
    if s.vocab_size < TINY_VOCAB:
        problems.append(f"--vocab_size {s.vocab_size}: the data's tokenizer has {TINY_VOCAB} tokens")
    if s.hidden_size % s.heads or s.heads % s.kv_heads:
        problems.append(
            f"--heads {s.heads}, --kv_heads {s.kv_heads}: heads must divide --hidden_size "
            f"{s.hidden_size}, and key/value heads the heads"
        )
    if s.lr_warmup_steps < 1:
        problems.append("--lr_warmup_steps: at least 1 (train.py reads 0 as 'use --warmup_ratio')")
    if problems:
        sys.exit("; ".join(problems))
    return s


def check_same_tokens(ours: dict, theirs: dict, s: argparse.Namespace) -> None:
    """Both sides trained the same whole blocks per step, and the same targets but for train.py's padding: it pads
    the epoch's last partial block where run_clm's group_texts drops it, so a step that draws that block has up
    to a block's targets fewer (at most once per epoch)."""
    if ours["input_tokens_per_step"] != theirs["input_tokens_per_step"]:
        raise RunFailed(
            f"the sides trained different blocks per step: train.py {ours['input_tokens_per_step']} "
            f"tokens, HF Trainer {theirs['input_tokens_per_step']}"
        )
    fewer = (theirs["targets_per_step"] - ours["targets_per_step"]) * s.steps
    if not 0 <= fewer < s.block_size * ours["epochs_touched"]:
        raise RunFailed(
            f"the sides trained different targets per step: train.py {ours['targets_per_step']}, HF "
            f"Trainer {theirs['targets_per_step']} (train.py's padding explains at most "
            f"{s.block_size - 1} fewer per epoch)"
        )


def measure(name: str, s: argparse.Namespace, tmp: Path) -> dict:
    env = common_env(tmp)
    model = build_model(tmp / "model", s)
    params = n_parameters(model_shape(s), s.heads, s.kv_heads)
    ds_config = tmp / "hf_ds_config.json"
    ds_config.write_text(json.dumps(hf_ds_config(s.zero_stage), indent=2))
    print(
        f"## {name}: {s.ranks} rank(s), Llama hidden {s.hidden_size}, {s.layers} layers, {s.heads} heads "
        f"({s.kv_heads} key/value), vocab {s.vocab_size} "
        f"({params / 1e6:.2f}M parameters), {s.batch} x {s.block_size} tokens per rank per step, {s.steps} steps "
        f"(steady from step {s.warmup}), ZeRO-{s.zero_stage}, {s.precision}, attention {s.attn_implementation}, "
        f"eval of {s.eval_samples} blocks every {s.eval_steps} steps",
        flush=True,
    )
    runs = {"train.py": [], "hf_trainer": []}
    started = time.monotonic()
    for round_ in range(s.rounds):
        ours = run_ours(model, tmp / f"ours{round_}", s, env)
        runs["train.py"].append(ours)
        theirs = run_hf(model, ds_config, tmp / f"hf{round_}", s, env)
        runs["hf_trainer"].append(theirs)
        print(
            f"round {round_}: train.py {ours['tokens_per_s']:.0f} tok/s, max RSS {ours['max_rss_kb'] / 2**20:.2f} "
            f"GiB; HF Trainer {theirs['tokens_per_s']:.0f} tok/s, max RSS {theirs['max_rss_kb'] / 2**20:.2f} GiB",
            flush=True,
        )
        check_same_tokens(ours, theirs, s)
    medians = {
        side: {k: statistics.median(r[k] for r in rs) for k in ("max_rss_kb", "tree_peak_rss_kb", "tokens_per_s")}
        for side, rs in runs.items()
    }
    return {
        "setup": {k: v for k, v in vars(s).items() if k not in ("measure", "json", "work_dir")},
        "parameters": params,
        "hf_deepspeed_config": hf_ds_config(s.zero_stage),
        "runs": runs,
        "median": medians,
        "ratio": {k: medians["train.py"][k] / medians["hf_trainer"][k] for k in medians["train.py"]},
        # Each round runs the two sides back to back: the ratio within a round is less exposed to the machine's
        # drift between rounds (another job, a neighbour on a shared host) than the ratio of the medians.
        "round_ratios": [
            ours["tokens_per_s"] / theirs["tokens_per_s"]
            for ours, theirs in zip(runs["train.py"], runs["hf_trainer"], strict=True)
        ],
        "wall_s": round(time.monotonic() - started, 1),
    }


def rows(name: str, result: dict) -> list:
    s, m, ratio = result["setup"], result["median"], result["ratio"]
    where = f"{s['ranks']} rank(s), ZeRO-{s['zero_stage']}, {s['precision']}, median of {s['rounds']}" + (
        f", train.py {s['ours_flags']}" if s.get("ours_flags") else ""
    )
    ours, hf = m["train.py"], m["hf_trainer"]
    return [
        f"| {name}: peak RSS (GNU time max RSS), {where} | {ours['max_rss_kb'] / 2**20:.2f} GiB | "
        f"{hf['max_rss_kb'] / 2**20:.2f} GiB | {ratio['max_rss_kb']:.3f} |",
        f"| {name}: steady tokens/s, {where} | {ours['tokens_per_s']:.0f} | {hf['tokens_per_s']:.0f} | "
        f"{ratio['tokens_per_s']:.3f} (the rounds' own: {', '.join(f'{r:.3f}' for r in result['round_ratios'])}; "
        f"median {statistics.median(result['round_ratios']):.3f}) |",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", choices=("memory", "throughput", "both"), default="both")
    for flag in (
        "ranks",
        "hidden_size",
        "layers",
        "heads",
        "kv_heads",
        "vocab_size",
        "block_size",
        "steps",
        "warmup",
        "logging_steps",
    ):
        p.add_argument(f"--{flag}", type=int, help="default: the measure's setup (see the docstring)")
    p.add_argument("--batch", type=int, help="blocks per rank per step (default: 4)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--zero_stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--attn_implementation", default="sdpa")
    p.add_argument("--eval_samples", type=int, default=4, help="validation blocks per evaluation (both sides)")
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps (default: only at the end)")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--lr_warmup_steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max_rss_gb", type=float, default=20.0, help="stop a run whose process tree passes this (GiB)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument(
        "--work_dir", help="keep the model, run folders and logs here (a new folder; default: a temporary one, removed)"
    )
    p.add_argument("--json", help="write every figure (each run, medians, ratios, setups) to this file")
    p.add_argument("--ours_flags", default="", help='extra train.py flags, e.g. "--torch_compile" (one side only)')
    cli = p.parse_args()

    names = ("memory", "throughput") if cli.measure == "both" else (cli.measure,)
    results, table = {}, []
    try:
        for name in names:
            if cli.work_dir:
                (Path(cli.work_dir) / name).mkdir(parents=True)
                results[name] = measure(name, settings(name, cli), Path(cli.work_dir) / name)
            else:
                with tempfile.TemporaryDirectory(prefix=f"compare_hf_{name}_") as tmp:
                    results[name] = measure(name, settings(name, cli), Path(tmp))
            table += rows(name, results[name])
    except RunFailed as failed:
        sys.exit(f"a run failed:\n{failed}")
    finally:
        if cli.json and results:
            Path(cli.json).write_text(json.dumps(results, indent=2))
    print("\n| figure | train.py | HF Trainer + DeepSpeed | ratio (train.py / HF) |\n|---|---|---|---|")
    print("\n".join(table))
    print(
        json.dumps(
            {name: {"median": r["median"], "ratio": r["ratio"], "wall_s": r["wall_s"]} for name, r in results.items()}
        )
    )


if __name__ == "__main__":
    main()
