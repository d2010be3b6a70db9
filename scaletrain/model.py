"""Tokenizer and model loading: pretrained or from a config, built sharded under ZeRO-3."""

from __future__ import annotations

import logging
from typing import Any

from scaletrain.config import RunConfig, UsageError

log = logging.getLogger(__name__)


def load_model_config(cfg: RunConfig):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model_source, trust_remote_code=cfg.trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(
                f"{cfg.model_source}: the model needs custom code from its repository",
                "pass --trust_remote_code if you trust that code",
            ) from exc
        raise


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_source, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise UsageError(
            f"--tokenizer_name {cfg.tokenizer_source}: the tokenizer has no EOS token",
            "documents are joined with EOS; use a tokenizer that defines one",
        )
    if tokenizer.pad_token_id is None:
        # Padding only fills the last, partial block and is masked out of the loss, so EOS serves.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(cfg: RunConfig, model_config, ds_config: dict, zero_stage: int) -> tuple:
    """Return (model, keepalive). Under ZeRO-3 each parameter is partitioned as it is created.

    transformers builds the model inside `deepspeed.zero.Init` while an `HfDeepSpeedConfig` is alive, both for
    `from_pretrained` (weights are loaded shard by shard into the partitions) and `from_config`. The returned
    keepalive must outlive the engine: transformers holds only a weak reference to it.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keepalive: Any = HfDeepSpeedConfig(ds_config) if zero_stage == 3 else None
    if cfg.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model_name_or_path,
            config=model_config,
            dtype=torch.float32,  # DeepSpeed keeps fp32 master weights and casts for bf16/fp16 itself
            trust_remote_code=cfg.trust_remote_code,
        )
    else:
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=cfg.trust_remote_code)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with ZeRO-3's parameter hooks and with inputs that need no grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    log.info("model: %s (%s), %.2fM parameters%s", type(model).__name__, cfg.model_source, n_params / 1e6,
             ", built sharded (ZeRO-3)" if zero_stage == 3 else "")
    return model, keepalive


def max_positions(model_config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1024
