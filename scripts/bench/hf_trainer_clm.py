"""The Hugging Face side of scripts/compare_hf_trainer.py: run_clm's recipe under the Trainer with DeepSpeed.

Model from a config (random init after set_seed, as run_clm does), the sample corpus tokenized and grouped into
blocks (run_clm's tokenize + group_texts: documents concatenated, cut into --block_size blocks, the remainder
dropped, labels = input_ids), Trainer(TrainingArguments(deepspeed=<the JSON>)), evaluation by steps and at the
end over the first --max_eval_samples validation blocks. Nothing else: no metrics beyond the Trainer's, no save.

    deepspeed --num_gpus N scripts/bench/hf_trainer_clm.py --config_name DIR --deepspeed ds.json \
        --output_dir DIR --block_size 256 --per_device_train_batch_size 4 --max_steps 60 ...

A callback stamps the wall-clock time at the end of every optimizer step; the training step counts the input
tokens and target labels each rank trained on. Rank 0 writes both to <output_dir>/hf_steps.json, so that
tokens/s is computed exactly as from train.py's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from itertools import chain
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

REPO = Path(__file__).resolve().parents[2]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", required=True)
    p.add_argument("--tokenizer_name", default=None, help="default: the config folder")
    p.add_argument("--train_file", default=str(REPO / "data" / "sample" / "train.jsonl"))
    p.add_argument("--validation_file", default=str(REPO / "data" / "sample" / "validation.jsonl"))
    p.add_argument("--deepspeed", required=True, help='DeepSpeed JSON (the Trainer fills its "auto" values)')
    p.add_argument("--output_dir", required=True)
    p.add_argument("--block_size", type=int, required=True)
    p.add_argument("--per_device_train_batch_size", type=int, required=True)
    p.add_argument("--per_device_eval_batch_size", type=int, required=True)
    p.add_argument("--max_eval_samples", type=int, required=True)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--eval_steps", type=int, required=True, help="must divide --max_steps (an eval at the end)")
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.95)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--attn_implementation", default="sdpa")
    p.add_argument("--gradient_checkpointing", action="store_true", help="TrainingArguments(gradient_checkpointing)")
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    return p.parse_args()


class StepClock(TrainerCallback):
    """Wall-clock time at the end of every optimizer step (same clock as train.py's metrics.jsonl)."""

    def __init__(self) -> None:
        self.steps, self.times = [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        self.times.append(time.time())


class CountingTrainer(Trainer):
    """The Trainer, counting the input tokens and target labels of every micro-batch this rank trains on (no
    collective in the loop: the counts are summed over ranks once, after training)."""

    input_tokens = 0
    targets = 0

    def training_step(self, model, inputs, *args, **kwargs):
        self.input_tokens += int(inputs["input_ids"].numel())
        self.targets += int((inputs["labels"][:, 1:] != -100).sum())
        return super().training_step(model, inputs, *args, **kwargs)


def accelerate_on_cpu_ranks() -> None:
    """Let accelerate 1.15 see the deepspeed launcher's ranks on a machine without a GPU.

    Its PartialState calls a process with no GPU "not distributed" (world size 1: the Trainer then fills
    train_batch_size for one rank and DeepSpeed, which sees them all, refuses it) unless it is told cpu=True
    (`use_cpu`), and cpu=True turns DeepSpeed off (the plain Trainer loop runs, silently). Here a rank with no
    accelerator takes the multi-CPU path (gloo) instead, where accelerate initialises DeepSpeed's comm and
    switches to DeepSpeed exactly as on GPUs. Nothing changes where there is a GPU.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if kind == DistributedType.NO and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    PartialState._prepare_backend = prepare_backend


def grouped_datasets(args, tokenizer, training_args):
    """run_clm.py's data path: load the json files, tokenize, group_texts into blocks, labels = input_ids."""
    raw = load_dataset("json", data_files={"train": args.train_file, "validation": args.validation_file})

    def tokenize(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // args.block_size) * args.block_size
        result = {
            k: [t[i : i + args.block_size] for i in range(0, total, args.block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="tokenize and group"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
        # run_clm groups 1000 documents at a time; one group over the whole split keeps the block count
        # independent of that batching (and equal to a packing of the whole split).
        lm = tokenized.map(group_texts, batched=True, batch_size=None)
    if len(lm["validation"]) < args.max_eval_samples:
        raise SystemExit(
            f"only {len(lm['validation'])} validation blocks of {args.block_size}, "
            f"--max_eval_samples {args.max_eval_samples} asked"
        )
    return lm["train"], lm["validation"].select(range(args.max_eval_samples))


def deepspeed_facts(trainer: Trainer) -> dict:
    """What the Trainer actually ran: the engine, its ZeRO stage, optimizers and batch (None without DeepSpeed)."""
    engine = trainer.model_wrapped
    if trainer.accelerator.state.distributed_type != "DEEPSPEED" or not hasattr(engine, "zero_optimization_stage"):
        return None
    return {
        "engine": type(engine).__name__,
        "zero_stage": engine.zero_optimization_stage(),
        "optimizer": type(engine.optimizer).__name__,
        "basic_optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
        "train_batch_size": engine.train_batch_size(),
        "world_size": engine.world_size,
        "precision": "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32",
    }


def main() -> None:
    args = parse_args()
    ds_config = json.loads(Path(args.deepspeed).read_text())
    optimizer = ds_config.get("optimizer", {})
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if not torch.cuda.is_available() and optimizer.get("type", "").lower() in ("adam", "adamw") and offload == "none":
        # DeepSpeed's Adam is FusedAdam, a JIT-built op; on a CPU torch's AdamW (what train.py uses there too).
        optimizer.setdefault("params", {})["torch_adam"] = True
    if args.max_steps % args.eval_steps:
        raise SystemExit(f"--eval_steps {args.eval_steps} must divide --max_steps {args.max_steps}")
    if not torch.cuda.is_available():
        accelerate_on_cpu_ranks()
    threads = torch.get_num_threads()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=ds_config,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",  # train.py's default: cosine to --min_lr_ratio of the peak
        lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio},
        warmup_steps=args.warmup_steps,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        bf16=args.bf16,
        seed=args.seed,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    print(f"rank {training_args.process_index}: device {training_args.device}")  # sets up the process group
    assert training_args.world_size == int(os.environ.get("WORLD_SIZE", 1)), "accelerate missed the ranks"
    # accelerate's multi-CPU path sets cores / local ranks threads per rank; train.py keeps torch's default, so
    # does this side (the comparison is of the training code, not of the thread count).
    torch.set_num_threads(threads)
    set_seed(args.seed)
    config = AutoConfig.from_pretrained(args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.config_name)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation)
    train, validation = grouped_datasets(args, tokenizer, training_args)

    clock = StepClock()
    trainer = CountingTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=validation,
        data_collator=default_data_collator,
        callbacks=[clock],
    )
    trainer.train()  # eval_strategy="steps" evaluates at the last step too: --eval_steps divides --max_steps
    evals = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]

    counts = torch.tensor([trainer.input_tokens, trainer.targets], dtype=torch.int64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    if training_args.process_index == 0:
        steps = clock.steps[-1]
        record = {
            "steps": clock.steps,
            "times": clock.times,
            "input_tokens_per_step": int(counts[0]) / steps,
            "targets_per_step": int(counts[1]) / steps,
            "world_size": training_args.world_size,
            "eval_losses": evals,
            "eval_blocks": len(validation),
            "train_blocks": len(train),
            "deepspeed": deepspeed_facts(trainer),
            "device": str(training_args.device),
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }
        (Path(args.output_dir) / "hf_steps.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
