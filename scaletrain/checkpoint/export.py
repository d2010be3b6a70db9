"""Exporting the trained model in Hugging Face's format: the full weights gathered onto rank 0 (ZeRO-3 partitions
one parameter at a time, tensor-parallel shards through DeepSpeed), a LoRA adapter (merged on request), or a
pipeline's weights read from its checkpoint's layer files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from scaletrain.checkpoint.commit import newest_committed
from scaletrain.distributed import LAYER_MAP

log = logging.getLogger(__name__)


def state_is_sharded_by_tp(engine) -> bool:
    return int(engine.autotp_size() or 0) > 1


def _full_state_dict_on_rank0(engine, is_main: bool, trainable_only: bool = False) -> dict:
    """The trained weights as one CPU state dict on rank 0 (empty elsewhere); with trainable_only, the parameters
    that train (a LoRA adapter's) and nothing else.

    Under ZeRO-3 each rank holds a slice of every parameter; gathering them one at a time keeps the peak to one
    full parameter per rank, and the CPU copy on rank 0 is the only whole model anywhere. (Saving the module's
    own state_dict under ZeRO-3 is the known pitfall: it writes empty placeholders.)
    """
    import deepspeed

    module = engine.module
    if state_is_sharded_by_tp(engine):  # AutoTP shards: DeepSpeed gathers them (a collective)
        from scaletrain.engine import gathered_state_dict

        state = gathered_state_dict(engine)
        return {k: v.detach().cpu().clone() for k, v in state.items()} if is_main else {}
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad or not trainable_only]
    if engine.zero_optimization_stage() != 3:
        if not is_main:
            return {}
        if trainable_only:
            return {name: p.detach().cpu().clone() for name, p in params}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    state = {}
    for name, param in params:
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if is_main:
                state[name] = param.detach().cpu().clone()
    if is_main and not trainable_only:
        for name, buf in module.named_buffers():
            # Non-persistent buffers (rotary tables) are rebuilt from the config; only persistent ones are saved.
            if name in module.state_dict():
                state[name] = buf.detach().cpu().clone()
    return state


def export_pipeline_checkpoint(
    ckpt: Path, out_dir, model_config, tokenizer, dtype=None, max_shard_size: str = "5GB"
) -> None:
    """A Hugging Face folder from a pipeline checkpoint's layer files (the weights each stage holds, each tensor
    rank's shards joined)."""
    import torch
    from transformers import AutoModelForCausalLM

    from scaletrain.distributed import hf_state_dict_from_layer_files

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    state = hf_state_dict_from_layer_files(ckpt, json.loads((ckpt / LAYER_MAP).read_text()), shapes)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(model_config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{ckpt}: the layer files do not match the model (missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)})"
        )
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out_dir)


def export_hf_model(
    engine, *, tokenizer, out_dir: str, is_main: bool, merge_lora: bool = False, trust_remote_code: bool = False
) -> None:
    """Write safetensors weights, config and tokenizer that `AutoModelForCausalLM.from_pretrained` loads; for a
    LoRA model the adapter folder instead (and with merge_lora the merged model in <out_dir>/merged)."""
    from scaletrain.distributed import barrier
    from scaletrain.model import is_lora_model, merge_adapter, merged_dir, save_adapter

    if is_lora_model(engine.module):
        adapter = _full_state_dict_on_rank0(engine, is_main, trainable_only=True)  # gathered: never placeholders
        if is_main:
            save_adapter(engine.module, adapter, out_dir, tokenizer)
            if merge_lora:
                merge_adapter(out_dir, merged_dir(out_dir), tokenizer, trust_remote_code)
        barrier()
        return
    if hasattr(engine.module, "scaletrain_layers"):  # a pipeline: rank 0 reads every stage's layer files
        if is_main:
            ckpt = newest_committed(Path(out_dir))
            assert ckpt is not None  # a pipeline's export reads the checkpoint the end of training committed
            export_pipeline_checkpoint(ckpt, out_dir, engine.module.hf_config, tokenizer)
            log.info("exported Hugging Face model to %s (from the pipeline's layer files)", out_dir)
        barrier()
        return
    state = _full_state_dict_on_rank0(engine, is_main)
    if is_main:
        engine.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        log.info("exported Hugging Face model to %s", out_dir)
    barrier()
