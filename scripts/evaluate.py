"""Benchmark scores of any model a run wrote, with EleutherAI's lm-evaluation-harness:

    python scripts/evaluate.py runs/default --tasks arc_easy,hellaswag [--limit N] [--batch_size B] [--num_fewshot K]
    deepspeed --num_gpus 8 scripts/evaluate.py runs/big --tasks mmlu --dtype bfloat16    # ZeRO-3 inference

PATH is an export folder (config.json and weights, or a LoRA adapter folder), a committed checkpoint folder
(runs/x/checkpoints/step300: exported first, into a temporary folder beside the results), or a run folder (its newest
committed checkpoint). Tasks are lm-eval's names or paths to task YAML files or folders, as train.py's
--lm_eval_tasks. lm-eval's results JSON goes to PATH/lm_eval/ (evaluate_step<N>_<time>.json for a checkpoint,
evaluate_<time>.json for an export) and its table to the console.

One process evaluates with lm-eval's own Hugging Face model (`lm_eval --model hf`, the same numbers); several
(deepspeed, torchrun) build the model sharded under ZeRO-3 and split the requests over the ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from pathlib import Path


from scaletrain.checkpoint.commit import committed_step, newest_committed, verify
from scaletrain.config import HarnessArgs
from scaletrain.errors import UsageError
from scaletrain.harness import resolve_tasks
from scaletrain.harness.results import RESULTS_DIR

DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="an export folder, a committed checkpoint folder or a run folder")
    parser.add_argument(
        "--tasks", required=True, help="lm-eval task or group names, or task YAML paths, comma-separated"
    )
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    parser.add_argument("--batch_size", type=int, default=8, help="requests per forward on each rank")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument("--log_samples", action="store_true", help="also write every item's responses (JSONL)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the export's own (config.json)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return parser.parse_args(argv)


def model_source(path: Path) -> tuple:
    """(what to evaluate, the checkpoint to export first or None, the step or None) for PATH."""
    if not path.is_dir():
        raise UsageError(f"{path}: no such folder", "give an export folder, a checkpoint folder or a run folder")
    if (path / "checkpoints").is_dir():  # a run folder
        newest = newest_committed(str(path))
        if newest is None:
            raise UsageError(f"{path}: a run folder without a committed checkpoint", "give its export folder instead")
        return newest, newest, committed_step(newest)
    if committed_step(path) is not None or (path / "commit.json").exists():
        problem = verify(path)
        if problem:
            raise UsageError(f"{path}: not a committed checkpoint ({problem})", "evaluate another checkpoint")
        return path, path, committed_step(path)
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path, None, None
    raise UsageError(
        f"{path}: neither an export (config.json), a committed checkpoint nor a run folder",
        "give a folder train.py or scripts/export_hf.py wrote",
    )


def export_checkpoint(checkpoint: Path, folder: Path, is_main: bool) -> Path:
    """The checkpoint as a Hugging Face folder (fp32 master weights; a LoRA run's merged model), written by rank 0."""
    from scripts.export_hf import export

    from scaletrain.model.lora import merged_dir, peft_args_of

    run_config = checkpoint.parent.parent / "run_config.json"
    lora = run_config.is_file() and peft_args_of(json.loads(run_config.read_text())) is not None
    if is_main:
        shutil.rmtree(folder, ignore_errors=True)
        export(checkpoint, folder, "float32", "5GB", merge_lora=lora)
    return merged_dir(folder) if lora else folder


def harness_lm(folder: Path, args: argparse.Namespace, dist):
    """lm-eval's HFLM on one process; on several, the model sharded under ZeRO-3 and every rank a share."""
    import torch

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if dist.world_size == 1:
        from lm_eval.models.huggingface import HFLM

        adapter = (folder / "adapter_config.json").is_file()
        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] if adapter else None
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return HFLM(
            pretrained=base or str(folder),
            peft=str(folder) if adapter else None,
            dtype=args.dtype,
            batch_size=args.batch_size,
            device=device,
        )
    return _zero3_lm(folder, args, dist, dtype)


def _zero3_lm(folder: Path, args: argparse.Namespace, dist, dtype):
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig

    from scaletrain.harness.live_model import engine_lm

    if (folder / "adapter_config.json").is_file():
        raise UsageError(
            f"{folder}: a LoRA adapter, which several ranks cannot shard",
            "evaluate its merged model (export with --merge_lora), or run on one process",
        )
    config = json.loads((folder / "config.json").read_text())
    name = args.dtype if args.dtype != "auto" else str(config.get("dtype") or config.get("torch_dtype") or "float32")
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": name == "bfloat16"},
        "fp16": {"enabled": name == "float16"},
    }
    keep = HfDeepSpeedConfig(ds_config)  # alive while the weights load: each rank keeps its shard only
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto")
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    del keep
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return engine_lm(
        engine.module, tokenizer, args.batch_size, rank=dist.rank, world_size=dist.world_size, lockstep=True
    )


def evaluate(args: argparse.Namespace, dist) -> dict | None:
    """Check everything, export a checkpoint, evaluate; lm-eval's results on rank 0."""
    from scaletrain.harness.scoring import score

    harness = HarnessArgs(
        lm_eval_tasks=args.tasks,
        lm_eval_limit=args.limit,
        lm_eval_batch_size=args.batch_size,
        lm_eval_num_fewshot=args.num_fewshot,
        lm_eval_log_samples=args.log_samples,
    )
    harness.validate()
    source, checkpoint, step = model_source(args.path)
    tasks = resolve_tasks(harness.task_specs, args.limit, dist.world_size, "--tasks")  # before any model is read
    out = args.path
    scratch = out / RESULTS_DIR / f".export-step{step}"
    try:
        if checkpoint is not None:
            source = export_checkpoint(checkpoint, scratch, dist.is_main)
            _sync(dist)
        lm = harness_lm(source, args, dist)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"evaluate_step{step}_{stamp}" if step is not None else f"evaluate_{stamp}"
        scores = score(lm, tasks=tasks, args=harness, out_dir=out if dist.is_main else None, name=name, step=step)
    finally:
        _sync(dist)
        if dist.is_main:
            shutil.rmtree(scratch, ignore_errors=True)
    return None if scores is None else scores.results


def _sync(dist) -> None:
    if dist.world_size > 1:
        from scaletrain.distributed import barrier

        barrier()


def main(argv=None) -> int:
    from scaletrain.distributed import init_distributed, read_launch_env, teardown_distributed
    from scaletrain.logs import setup_logging

    args = parse(argv)
    dist = read_launch_env()
    setup_logging(dist.rank)
    try:
        if dist.world_size > 1:
            dist = init_distributed(dist)
        results = evaluate(args, dist)
    except UsageError as err:
        if dist.is_main:
            print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.world_size > 1:
            teardown_distributed(dist.rank)
    if results is not None:
        from lm_eval.utils import make_table

        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
