"""LoRA through peft: a way of building the model. The pretrained weights stay frozen and only the adapter trains.

    checked before anything heavy (check_lora) -> get_peft_model on the built model (apply_lora; ZeRO-3: the base is
    already partitioned, and deepspeed.initialize partitions the new adapter weights, broadcast from rank 0)
    -> the engine's optimizer gets the adapter's parameters only (engine.parameter_groups skips frozen ones)
    -> checkpoints: DeepSpeed's, holding the adapter's weights and optimizer states (and the frozen base)
    -> export: an adapter folder `PeftModel.from_pretrained` loads (save_adapter), with --merge_lora also the
       merged full model (merge_adapter).

Under ZeRO-3 a module's own state_dict holds empty placeholders, the known cause of empty adapters (peft#2500,
trl#4416): the export gathers the adapter's parameters first (checkpoint._full_state_dict_on_rank0).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from scaletrain.config import PeftArgs
from scaletrain.errors import UsageError

log = logging.getLogger(__name__)
MERGED_DIR = "merged"


def describe(args: PeftArgs) -> str:
    """The adapter's shape in one line: checkpoints record it, and a resume with another one is refused."""
    return f"lora r={args.lora_r} alpha={args.lora_alpha} targets={args.lora_target_modules}"


def _adaptable_modules(model) -> dict:
    """{module path: module} of the layers peft's LoRA wraps (linear, embedding, convolution)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, Conv1D)
    return {name: module for name, module in model.named_modules() if isinstance(module, kinds)}


def check_lora(args: PeftArgs, skeleton, accelerator: str, is_moe: bool) -> None:
    """On the meta model, before anything heavy: every --lora_target_modules name is a layer of the model (else the
    names there are), no mixture-of-experts model (untested). --load_in_4bit: qlora.check_qlora."""
    if is_moe:
        raise UsageError("--use_peft with a mixture-of-experts model: not supported here (untested)",
                         "train a dense model's adapter, or train the MoE model without --use_peft")
    targets = args.target_modules
    if targets == "all-linear":
        return
    modules = _adaptable_modules(skeleton)
    available = sorted({name.rsplit(".", 1)[-1] for name in modules})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in modules):
            raise UsageError(f"--lora_target_modules {args.lora_target_modules}: {type(skeleton).__name__} has no "
                             f"layer named {target}", f"its layers: {', '.join(available)} (or all-linear)")


def lora_config(args: PeftArgs):
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=args.target_modules, bias="none", task_type="CAUSAL_LM")


def apply_lora(model, args: PeftArgs):
    """The model wrapped by peft: adapter weights added, every other parameter frozen."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, lora_config(args))
    trainable, total = wrapped.get_nb_trainable_parameters()  # counts ZeRO-3 partitions by their full size
    log.info("LoRA (%s, dropout %g): %.3fM trainable of %.2fM parameters (%.2f%%)", describe(args),
             args.lora_dropout, trainable / 1e6, total / 1e6, 100 * trainable / total)
    return wrapped


def is_lora_model(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def meta_lora_model(model_config, args: PeftArgs, base_model_name_or_path: str, trust_remote_code: bool):
    """The LoRA-wrapped model on the meta device (no memory): what an offline export saves an adapter through."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    base.config.name_or_path = base_model_name_or_path  # adapter_config.json's base_model_name_or_path
    from peft import get_peft_model

    return get_peft_model(base, lora_config(args))


def save_adapter(peft_model, adapter_state: dict, out_dir, tokenizer) -> None:
    """adapter_config.json, adapter_model.safetensors and the tokenizer: a folder PeftModel.from_pretrained (and
    AutoModelForCausalLM.from_pretrained, through peft) loads. `adapter_state`: the adapter's full weights by the
    wrapped model's parameter names (peft keeps the lora_ ones and drops the adapter name)."""
    missing = [name for name, param in peft_model.named_parameters()
               if param.requires_grad and name not in adapter_state]
    assert not missing, f"adapter weights missing from the export: {missing[:3]}"
    peft_model.save_pretrained(str(out_dir), state_dict=adapter_state, safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    log.info("exported the LoRA adapter to %s (%d tensors)", out_dir, len(adapter_state))


@contextmanager
def _plain_model_loading():
    """transformers builds every model inside deepspeed.zero.Init (a collective) while an HfDeepSpeedConfig of
    ZeRO-3 is alive; the merge runs on rank 0 alone, so it loads a plain CPU model with that switched off."""
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref
    alive = reference() if reference is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if alive is not None:
            hf_deepspeed.set_hf_deepspeed_config(alive)


def merge_adapter(adapter_dir, out_dir, tokenizer, trust_remote_code: bool = False, dtype=None,
                  max_shard_size: str = "5GB") -> None:
    """The base model (adapter_config.json's base_model_name_or_path) with the adapter merged into its weights
    (peft's merge_and_unload), saved as a plain Hugging Face model folder."""
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    base_source = PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    with _plain_model_loading():
        base = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32,
                                                    trust_remote_code=trust_remote_code)
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    if dtype is not None:
        merged = merged.to(dtype)
    merged.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(out_dir))
    log.info("exported the merged model (%s + adapter) to %s", base_source, out_dir)


def peft_args_of(run_config: dict) -> Optional[PeftArgs]:
    """The PeftArgs a run's run_config.json records, or None for a run without --use_peft."""
    import dataclasses

    if not run_config.get("use_peft"):
        return None
    return PeftArgs(**{f.name: run_config[f.name] for f in dataclasses.fields(PeftArgs) if f.name in run_config})


def merged_dir(out_dir) -> Path:
    return Path(out_dir) / MERGED_DIR
