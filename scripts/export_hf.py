"""Export a committed checkpoint (ZeRO-1/2/3, offloaded or not, or pipeline-parallel) as a Hugging Face model folder.

    python scripts/export_hf.py runs/default/checkpoints/step300 exported/ [--dtype bfloat16]

Writes safetensors shards (with an index when sharded), config.json, the tokenizer, generation_config.json and a
model card (scaletrain/checkpoint/publish.py);
--push_to_hub owner/name then uploads the folder. A LoRA checkpoint (--use_peft)
exports its adapter folder instead of the weights, and with --merge_lora also the merged model in <out_dir>/merged.
The fp32 master weights are read from the ZeRO shards lazily and written shard by shard (DeepSpeed's converter in
lazy mode), so the whole model is never held twice in memory. A pipeline-parallel checkpoint is read from its
per-layer files (the weights the stages held). The model and tokenizer come from the run's run_config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


from scaletrain.checkpoint.commit import committed_step, verify
from scaletrain.checkpoint.export import export_pipeline_checkpoint
from scaletrain.checkpoint.resume import read_train_state
from scaletrain.config.slices import DEFAULT_MODEL_DIR
from scaletrain.errors import UsageError
from scaletrain.model.lora import merged_dir, peft_args_of
from scaletrain.observability.metrics import METRICS_FILE, read_records
from scaletrain.checkpoint.publish import check_push_target, push_to_hub, write_generation_config, write_model_card


@dataclass(frozen=True)
class BaseModel:
    """The run's model, which a LoRA adapter was trained on: its config, where it came from, its tokenizer."""

    config: object
    source: str
    tokenizer: object
    trust_remote_code: bool


def export_lora(
    ckpt: Path, out: Path, peft_args, base: BaseModel, dtype, max_shard_size: str, merge_lora: bool
) -> None:
    """A LoRA checkpoint: its adapter (the trainable parameters of the ZeRO shards) as an adapter folder, and with
    --merge_lora the merged model in <out>/merged."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from scaletrain.model import lora

    adapter = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name, exclude_frozen_parameters=True)
    model = lora.meta_lora_model(base.config, peft_args, base.source, base.trust_remote_code)
    lora.save_adapter(model, {name: tensor.to(dtype) for name, tensor in adapter.items()}, out, base.tokenizer)
    if merge_lora:
        lora.merge_adapter(out, lora.merged_dir(out), base.tokenizer, base.trust_remote_code, dtype, max_shard_size)


def export(ckpt: Path, out: Path, dtype: str, max_shard_size: str, merge_lora: bool = False) -> None:
    import torch
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
    from transformers import AutoConfig, AutoTokenizer

    if not ckpt.is_dir():
        raise UsageError(f"{ckpt}: no such checkpoint folder", "give a folder like runs/x/checkpoints/step100")
    problem = verify(ckpt)
    if problem:
        raise UsageError(f"{ckpt}: not a committed checkpoint ({problem})", "export another checkpoint")
    tensor_parallel = read_train_state(ckpt).get("tensor_parallel_size", 1)
    if tensor_parallel > 1:  # DeepSpeed's ZeRO reader finds one optimizer file per TP rank and stops
        raise UsageError(
            f"{ckpt}: saved with tensor parallelism {tensor_parallel}, which this script cannot merge",
            "resume it on one rank for no more steps (train.py --output_dir <its run> --max_steps "
            "<its step>): the checkpoint is converted, and the run's end exports the full weights",
        )
    run_config_path = ckpt.parent.parent / "run_config.json"
    try:
        run_config = json.loads(run_config_path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(
            f"{run_config_path}: cannot read the run's config", "export from a checkpoint inside its run folder"
        ) from err
    model_source = run_config.get("model_name_or_path") or run_config.get("config_name") or str(DEFAULT_MODEL_DIR)
    tokenizer_source = run_config.get("tokenizer_name") or model_source
    trust = bool(run_config.get("trust_remote_code"))
    peft_args = peft_args_of(run_config)
    if merge_lora and peft_args is None:
        raise UsageError(f"--merge_lora: {ckpt} is not from a LoRA run (--use_peft)", "drop --merge_lora")
    model_config = AutoConfig.from_pretrained(model_source, trust_remote_code=trust)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust)
    if peft_args is not None:
        base = BaseModel(model_config, model_source, tokenizer, trust)
        export_lora(ckpt, out, peft_args, base, getattr(torch, dtype), max_shard_size, merge_lora)
    elif read_train_state(ckpt).get("pipeline_parallel_size", 1) > 1:
        export_pipeline_checkpoint(
            ckpt, out, model_config, tokenizer, dtype=getattr(torch, dtype), max_shard_size=max_shard_size
        )
    else:
        convert_zero_checkpoint_to_state_dict(
            str(ckpt.parent),
            str(out),
            dtype=getattr(torch, dtype),
            max_shard_size=max_shard_size,
            safe_serialization=True,
            tag=ckpt.name,
        )
        model_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
    final = _final_metrics(ckpt.parent.parent / METRICS_FILE, committed_step(ckpt))
    for folder in (out, *([merged_dir(out)] if merge_lora else [])):
        write_generation_config(folder, tokenizer, model_config)
        write_model_card(folder, run_config, final)


def _final_metrics(path: Path, step: int) -> dict:
    """Each metric's newest value up to the checkpoint's step (the model card's final losses)."""
    latest: dict = {}
    if path.exists():
        for record in read_records(path)[0]:
            if record["step"] <= step:
                latest.update(record)
    return latest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument(
        "--merge_lora",
        action="store_true",
        help="A LoRA checkpoint: also write the merged model (base + adapter) to <out_dir>/merged.",
    )
    parser.add_argument(
        "--push_to_hub",
        metavar="REPO",
        help="then upload the folder to this Hub repository (owner/name), with HF_TOKEN from the environment",
    )
    parser.add_argument("--hub_private_repo", action="store_true", help="create the repository private")
    args = parser.parse_args(argv)
    try:
        check_push_target(args.push_to_hub, export_at_end=True)
        export(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.merge_lora)
    except UsageError as err:
        print(f"export_hf.py: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {args.out_dir}")
    if args.push_to_hub:
        try:
            print(f"pushed: {push_to_hub(args.out_dir, args.push_to_hub, private=args.hub_private_repo)}")
        except Exception as err:
            print(
                f"export_hf.py: push failed: {args.push_to_hub}: {type(err).__name__}: {str(err).splitlines()[0]}; "
                f"the export in {args.out_dir} is complete: run the same command again to resume",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
