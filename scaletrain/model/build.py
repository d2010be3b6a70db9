"""Tokenizer and model loading: pretrained or from a config, built sharded under ZeRO-3."""

from __future__ import annotations

import logging

from scaletrain.config import ModelArgs
from scaletrain.errors import UsageError
from scaletrain.model.activation_offload import install_activation_offloading
from scaletrain.model.tiled_mlp import install_tiled_mlp

log = logging.getLogger(__name__)


def _model_flag(args: ModelArgs) -> str:
    if args.model_name_or_path:
        return f"--model_name_or_path {args.model_name_or_path}"
    return f"--config_name {args.config_name}" if args.config_name else f"default model {args.model_source}"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:240] if text else type(exc).__name__


def load_model_config(args: ModelArgs):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(args.model_source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(
                f"{_model_flag(args)}: the model needs custom code from its repository",
                "pass --trust_remote_code if you trust that code",
            ) from exc
        raise UsageError(
            f"{_model_flag(args)}: cannot load its config ({_first_line(exc)})",
            "give a folder with a config.json, or a hub id",
        ) from exc


def load_tokenizer(args: ModelArgs):
    from transformers import AutoTokenizer

    flag = f"--tokenizer_name {args.tokenizer_name}" if args.tokenizer_name else _model_flag(args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(
                f"{flag}: the tokenizer needs custom code from its repository",
                "pass --trust_remote_code if you trust that code",
            ) from exc
        raise UsageError(
            f"{flag}: cannot load a tokenizer from it ({_first_line(exc)})",
            "pass --tokenizer_name with a folder or hub id that holds one",
        ) from exc
    if tokenizer.eos_token_id is None:
        raise UsageError(
            f"{flag}: the tokenizer has no EOS token",
            "documents are joined with EOS; use a tokenizer that defines one",
        )
    if tokenizer.pad_token_id is None:
        # Padding only fills the last, partial block and is masked out of the loss, so EOS serves.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(args: ModelArgs, model_config, ds_config: dict, pipeline: bool = False) -> tuple:
    """Return (model, keepalive). Under ZeRO-3 transformers builds inside `deepspeed.zero.Init` while an
    `HfDeepSpeedConfig` is alive, so each parameter is partitioned as it is created; the keepalive must outlive the
    engine, as transformers holds only a weak reference to it. `pipeline`: built on the meta device, each stage then
    given only its own values (stage_weights.py).
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from scaletrain.model.stage_weights import stage_weights_model

    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    # Under tensor parallelism AutoTP shards whole weights at deepspeed.initialize, and ZeRO-3 then partitions the
    # shards over the data-parallel ranks: built whole (as under ZeRO-1/2 with TP), not inside zero.Init, whose
    # config would count every rank as data-parallel.
    sharded = zero3 and ds_config.get("tensor_parallel", {}).get("autotp_size", 1) <= 1
    keepalive = HfDeepSpeedConfig(ds_config) if sharded else None
    staged = stage_weights_model(args, model_config) if pipeline else None
    if staged is not None:
        model = staged
    elif args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path,
            config=model_config,
            dtype=torch.float32,  # DeepSpeed keeps fp32 master weights and casts for bf16/fp16 itself
            trust_remote_code=args.trust_remote_code,
            attn_implementation=args.attn_implementation,
        )
    else:
        model = AutoModelForCausalLM.from_config(
            model_config, trust_remote_code=args.trust_remote_code, attn_implementation=args.attn_implementation
        )
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing works with ZeRO-3's parameter hooks and with inputs that need no grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    install_memory_features(model, args)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    where = ""
    if sharded:
        where = ", built sharded (ZeRO-3)"
    elif staged is not None:
        where = ", on the meta device (each pipeline stage reads its own weights)"
    log.info(f"model: {type(model).__name__} ({args.model_source}), {n_params / 1e6:.2f}M parameters{where}")
    if zero3 and keepalive is None:  # alive for the engine's life all the same (generation's synced_gpus reads it)
        keepalive = HfDeepSpeedConfig(ds_config)
    return model, keepalive


def install_memory_features(model, args: ModelArgs) -> None:
    """The long-sequence memory features asked for: the tiled MLP, the checkpointed inputs offloaded to host."""
    if args.tiled_mlp:
        install_tiled_mlp(model, args.tiled_mlp_shards)
    if args.activation_offloading:
        install_activation_offloading(model)


def meta_model(model_config, trust_remote_code: bool, attn_implementation: str | None = None):
    """The model's structure without weights (meta device): parameter count and class facts, in seconds. An
    attention backend that is not installed, or that the model does not support, is a UsageError here; None lets
    transformers choose (its config's _attn_implementation then says what it chose)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                model_config, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
            )
    except (ImportError, ValueError) as exc:  # transformers' checks of the backend (installed, supported)
        raise UsageError(
            f"--attn_implementation {attn_implementation}: {_first_line(exc)}",
            "drop --attn_implementation to let transformers choose for this model (sdpa where the model has it, "
            "eager otherwise), or install the backend's package",
        ) from exc


def check_attention_isolation(
    attn_implementation: str, attention_isolation: bool, micro_batch: int, eval_batch: int
) -> None:
    """--attention_isolation is exact with sdpa, eager and flex attention at any micro-batch: transformers builds
    the per-document mask from the restarting position ids. Flash attention takes document boundaries from position
    ids only for a batch of 1 (else it attends across documents without a word), so a larger micro-batch is
    refused with it."""
    if attention_isolation and attn_implementation.startswith("flash_attention") and max(micro_batch, eval_batch) > 1:
        raise UsageError(
            f"--attention_isolation with --attn_implementation {attn_implementation}: batches of "
            f"{micro_batch} (training) and {eval_batch} (evaluation), and flash attention separates "
            "documents only in a batch of 1",
            "use --per_device_train_batch_size 1 and "
            "--per_device_eval_batch_size 1 (raise --gradient_accumulation_steps), or sdpa",
        )


def max_positions(model_config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1024
