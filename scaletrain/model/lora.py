"""LoRA through peft: a way of building the model, the pretrained weights frozen and only the adapter trained. Checked
before anything heavy (check_lora), applied to the built model (apply_lora), saved without the frozen base, so a
checkpoint records which base it needs (base_identity, check_same_base), and exported as an adapter folder
(save_adapter; merge_adapter with --merge_lora). Under ZeRO-3 a module's own state_dict holds empty placeholders, the
known cause of empty adapters (peft#2500, trl#4416), so the export gathers the adapter first. Details:
docs/fine-tuning.md#lora.
"""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path

from scaletrain.config import PeftArgs
from scaletrain.errors import UsageError

log = logging.getLogger(__name__)
MERGED_DIR = "merged"


def describe_adapter(args: PeftArgs) -> str:
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
        raise UsageError(
            "--use_peft with a mixture-of-experts model: not supported here (untested)",
            "train a dense model's adapter, or train the MoE model without --use_peft",
        )
    targets = args.target_modules
    if targets == "all-linear":
        return
    modules = _adaptable_modules(skeleton)
    available = sorted({name.rsplit(".", 1)[-1] for name in modules})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in modules):
            raise UsageError(
                f"--lora_target_modules {args.lora_target_modules}: {type(skeleton).__name__} has no "
                f"layer named {target}",
                f"its layers: {', '.join(available)} (or all-linear)",
            )


def lora_config(args: PeftArgs):
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model, args: PeftArgs):
    """The model wrapped by peft: adapter weights added, every other parameter frozen."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, lora_config(args))
    trainable, total = wrapped.get_nb_trainable_parameters()  # counts ZeRO-3 partitions by their full size
    log.info(
        f"LoRA ({describe_adapter(args)}, dropout {args.lora_dropout:g}): {trainable / 1e6:.3f}M trainable of "
        f"{total / 1e6:.2f}M parameters ({100 * trainable / total:.2f}%)"
    )
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
    missing = [
        name for name, param in peft_model.named_parameters() if param.requires_grad and name not in adapter_state
    ]
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


def merge_adapter(
    adapter_dir, out_dir, tokenizer, trust_remote_code: bool = False, dtype=None, max_shard_size: str = "5GB"
) -> None:
    """The base model (adapter_config.json's base_model_name_or_path) with the adapter merged into its weights
    (peft's merge_and_unload), saved as a plain Hugging Face model folder."""
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    base_source = PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    with _plain_model_loading():
        base = AutoModelForCausalLM.from_pretrained(
            base_source, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    if dtype is not None:
        merged = merged.to(dtype)
    merged.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(out_dir))
    log.info("exported the merged model (%s + adapter) to %s", base_source, out_dir)


def peft_args_of(run_config: dict) -> PeftArgs | None:
    """The PeftArgs a run's run_config.json records, or None for a run without --use_peft."""
    import dataclasses

    if not run_config.get("use_peft"):
        return None
    return PeftArgs(**{f.name: run_config[f.name] for f in dataclasses.fields(PeftArgs) if f.name in run_config})


def merged_dir(out_dir) -> Path:
    return Path(out_dir) / MERGED_DIR


# --- checkpoints without the frozen base ------------------------------------------------------------------------

# The base's fingerprint samples its weight files (a safetensors header and windows at each tensor's start, middle
# and end; 64 windows of a .bin): about 12 KiB a tensor (3.5 MiB for a 7B Llama) where a full SHA-256 of 14 GB takes
# 8 s per rank at every start. Another model or fine-tune differs there; only an edit between windows would pass.
BASE_WINDOW = 4096
FILE_WINDOWS, FILE_WINDOW = 64, 65536


def _base_folder(source: str) -> Path | None:
    """The folder with the base's weight files: --model_name_or_path itself, or its snapshot in the Hub cache
    (never downloaded here); None when neither is on this machine yet."""
    folder = Path(source)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:  # not cached (or no hub id): the identity falls back to the name
        return None


def _weight_files(folder: Path) -> list:
    """What from_pretrained reads: the safetensors files, or else the pickled ones (an adapter's excepted)."""
    for pattern in ("*.safetensors", "*.bin"):
        files = sorted(
            p for p in folder.glob(pattern) if p.is_file() and not p.name.startswith(("adapter_", "training_"))
        )
        if files:
            return files
    return []


def _digest_safetensors(f, size: int, digest) -> None:
    header_len = int.from_bytes(f.read(8), "little")
    header = f.read(header_len)
    digest.update(header)
    start = 8 + header_len
    for name, entry in sorted(json.loads(header).items()):
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        for offset in sorted({begin, max(begin, (begin + end) // 2 - BASE_WINDOW // 2), max(begin, end - BASE_WINDOW)}):
            f.seek(start + offset)
            digest.update(f.read(min(BASE_WINDOW, end - offset)))


def _digest_file(f, size: int, digest) -> None:
    for i in range(FILE_WINDOWS):
        f.seek(max(0, (size - FILE_WINDOW) * i // (FILE_WINDOWS - 1)))
        digest.update(f.read(FILE_WINDOW))


def base_identity(source: str) -> dict:
    """Which base a LoRA run trains on, as its checkpoints record it: {"source": --model_name_or_path, "weights": a
    sampled SHA-256 of its weight files (see BASE_WINDOW), or None when they are not on this machine}."""
    folder = _base_folder(source)
    files = _weight_files(folder) if folder is not None else []
    if not files:
        return {"source": source, "weights": None}
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with open(path, "rb") as f:
            (_digest_safetensors if path.suffix == ".safetensors" else _digest_file)(f, size, digest)
    return {"source": source, "weights": digest.hexdigest()[:32]}


def check_same_base(ckpt: Path, saved: dict | None, now: dict | None) -> None:
    """A LoRA checkpoint holds no base: refuse to resume it on other base weights than it was trained on (the
    weights decide: the same files moved elsewhere resume; where the weights of either are unknown, the names)."""
    if not saved or not now:
        return  # not a LoRA resume (the adapter fact refuses a change), or a checkpoint from before the record
    if saved.get("weights") and now.get("weights"):
        if saved["weights"] == now["weights"]:
            return
        what = f"other weights (fingerprint {saved['weights'][:12]} -> {now['weights'][:12]})"
    elif saved["source"] == now["source"]:
        return
    else:
        what = "another name, and weights that cannot be compared (not on this machine)"
    raise UsageError(
        f"--model_name_or_path {now['source']}: checkpoint {ckpt} holds a LoRA adapter trained on the "
        f"base {saved['source']}, not the base itself, and this base has {what}",
        f"resume with --model_name_or_path {saved['source']}, or start afresh with --resume_from_checkpoint none",
    )


def load_adapter_state(src: dict, dst) -> None:
    """DeepSpeed's module load for a checkpoint without the frozen base (custom_load_fn): the frozen parameters are
    the ones built from --model_name_or_path, and anything else missing or left over is an error."""
    result = dst.load_state_dict(src, strict=False)
    frozen = {name for name, p in dst.named_parameters() if not p.requires_grad}
    missing = [k for k in result.missing_keys if k not in frozen]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"the checkpoint's module state does not fit the LoRA model: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
