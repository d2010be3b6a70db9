"""Export a committed checkpoint (ZeRO-1/2/3, offloaded or not, or pipeline-parallel) as a Hugging Face model folder.

    python scripts/export_hf.py runs/default/checkpoints/step300 exported/ [--dtype bfloat16]

Writes safetensors shards (with an index when sharded), config.json and the tokenizer; a LoRA checkpoint
(--use_peft) exports its adapter folder instead, and with --merge_lora also the merged model in <out_dir>/merged.
The fp32 master weights are read from the ZeRO shards lazily and written shard by shard (DeepSpeed's converter in
lazy mode), so the whole model is never held twice in memory. A pipeline-parallel checkpoint is read from its
per-layer files (the weights the stages held). The model and tokenizer come from the run's run_config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain.checkpoint import export_pipeline_checkpoint, read_train_state, verify  # noqa: E402
from scaletrain.config import DEFAULT_MODEL_DIR, UsageError  # noqa: E402
from scaletrain.lora import peft_args_of  # noqa: E402


def export_lora(ckpt: Path, out: Path, peft_args, model_source: str, tokenizer_source: str, trust: bool, dtype,
                max_shard_size: str, merge_lora: bool) -> None:
    """A LoRA checkpoint: its adapter (the trainable parameters of the ZeRO shards) as an adapter folder, and with
    --merge_lora the merged model in <out>/merged."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoTokenizer

    from scaletrain import lora

    adapter = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name,
                                                       exclude_frozen_parameters=True)
    model_config = AutoConfig.from_pretrained(model_source, trust_remote_code=trust)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust)
    model = lora.meta_lora_model(model_config, peft_args, model_source, trust)
    lora.save_adapter(model, {name: tensor.to(dtype) for name, tensor in adapter.items()}, out, tokenizer)
    if merge_lora:
        lora.merge_adapter(out, lora.merged_dir(out), tokenizer, trust, dtype, max_shard_size)


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
        raise UsageError(f"{ckpt}: saved with tensor parallelism {tensor_parallel}, which this script cannot merge",
                         "resume it on one rank for no more steps (train.py --output_dir <its run> --max_steps "
                         "<its step>): the checkpoint is converted, and the run's end exports the full weights")
    run_config_path = ckpt.parent.parent / "run_config.json"
    try:
        run_config = json.loads(run_config_path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{run_config_path}: cannot read the run's config",
                         "export from a checkpoint inside its run folder") from err
    model_source = run_config.get("model_name_or_path") or run_config.get("config_name") or str(DEFAULT_MODEL_DIR)
    tokenizer_source = run_config.get("tokenizer_name") or model_source
    trust = bool(run_config.get("trust_remote_code"))
    peft_args = peft_args_of(run_config)
    if peft_args is not None:
        export_lora(ckpt, out, peft_args, model_source, tokenizer_source, trust, getattr(torch, dtype), max_shard_size,
                    merge_lora)
        return
    if merge_lora:
        raise UsageError(f"--merge_lora: {ckpt} is not from a LoRA run (--use_peft)", "drop --merge_lora")
    if read_train_state(ckpt).get("pipeline_parallel_size", 1) > 1:
        export_pipeline_checkpoint(ckpt, out, AutoConfig.from_pretrained(model_source, trust_remote_code=trust),
                                   AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust),
                                   dtype=getattr(torch, dtype), max_shard_size=max_shard_size)
        return
    convert_zero_checkpoint_to_state_dict(str(ckpt.parent), str(out), dtype=getattr(torch, dtype),
                                          max_shard_size=max_shard_size, safe_serialization=True, tag=ckpt.name)
    AutoConfig.from_pretrained(model_source, trust_remote_code=trust).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust).save_pretrained(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--merge_lora", action="store_true",
                        help="A LoRA checkpoint: also write the merged model (base + adapter) to <out_dir>/merged.")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.merge_lora)
    except UsageError as err:
        print(f"export_hf.py: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
