"""The model's pre-flight: the tokenizer against the model, the meta model and what a checkpoint must match, and
the model-side features a run asks for (attention backend, activation checkpointing, the tiled MLP, the router
loss, LoRA and QLoRA), checked before anything is built (a mistake ends the run with exit code 2)."""

from __future__ import annotations

import hashlib
import inspect

from scaletrain.config import HardwareFacts, ModelArgs, ResolvedDSConfig, RunConfig
from scaletrain.errors import UsageError
from scaletrain.model.build import check_attention_isolation, meta_model
from scaletrain.model.lora import base_identity, check_lora, describe_adapter
from scaletrain.model.moe import resolve_router_loss
from scaletrain.model.qlora import check_qlora
from scaletrain.model.tiled_mlp import check_tiled_mlp


def check_tokenizer_fits(model: ModelArgs, model_config, tokenizer) -> None:
    vocab = getattr(model_config.get_text_config(), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise UsageError(
            f"--tokenizer_name {model.tokenizer_source}: {len(tokenizer)} tokens, but the model's vocabulary has "
            f"{vocab}",
            "use the model's own tokenizer, or a config whose vocab_size covers the tokenizer",
        )


def describe_model(cfg: RunConfig, model_config) -> tuple:
    """(the meta model, its facts): what a checkpoint must match to be resumed by this model (its type, size,
    parameter names and shapes; with LoRA the adapter and the base it was trained on, since it holds no base)."""
    skeleton = meta_model(model_config, cfg.model.trust_remote_code, cfg.model.attn_implementation)
    facts = {
        **model_facts(skeleton, model_config),
        "adapter": describe_adapter(cfg.peft) if cfg.peft.use_peft else None,
    }
    if cfg.peft.use_peft:
        assert cfg.model.model_name_or_path is not None  # --use_peft needs it (config._check_peft_run)
        facts["base"] = base_identity(cfg.model.model_name_or_path)
    return skeleton, facts


def model_facts(skeleton, model_config) -> dict:
    """What a checkpoint must match to be resumed by this model: its type, size and parameter names and shapes."""
    names = ",".join(f"{n}:{tuple(p.shape)}" for n, p in skeleton.named_parameters())
    return {
        "model_type": getattr(model_config, "model_type", None),
        "n_params": sum(p.numel() for p in skeleton.parameters()),
        "parameter_names": hashlib.sha256(names.encode()).hexdigest()[:16],
    }


def check_model_features(
    cfg: RunConfig, *, ds: ResolvedDSConfig, skeleton, model_config, hardware: HardwareFacts, isolates_documents: bool
):
    """The attention backend with document isolation, activation checkpointing, LoRA and QLoRA against this model
    and engine; returns a mixture-of-experts model's load-balancing loss (moe.RouterLoss) or None."""
    one_row = cfg.data.padding_free  # preference pairs: a micro-batch of any size is one row
    check_attention_isolation(
        skeleton.config._attn_implementation,  # the backend named, or the one transformers chose
        isolates_documents,
        1 if one_row else ds.config["train_micro_batch_size_per_gpu"],
        1 if one_row else cfg.optim.per_device_eval_batch_size,
    )
    if isolates_documents and "position_ids" not in inspect.signature(skeleton.forward).parameters:
        # transformers keeps packed documents apart through the restarting position ids: a model that takes none
        # (BLOOM, whose ALiBi needs no positions) would attend across documents without a word.
        cause = (
            "--attention_isolation"
            if cfg.data.attention_isolation
            else "--padding_free"
            if cfg.data.padding_free
            else "chat data (whole examples, isolated)"
        )
        raise UsageError(
            f"{cause}: {type(skeleton).__name__} takes no position_ids, so packed documents cannot be kept apart",
            "use a model whose forward takes position_ids (Llama, Qwen, Mistral, GPT-2, ...)"
            + (", or drop --attention_isolation" if cfg.data.attention_isolation else "")
            + (", or drop --padding_free" if cfg.data.padding_free else ""),
        )
    if cfg.model.gradient_checkpointing and not getattr(skeleton, "supports_gradient_checkpointing", False):
        raise UsageError(
            f"--gradient_checkpointing: {type(skeleton).__name__} does not support it",
            "drop the flag, or use ZeRO-3 / offload to save memory instead",
        )
    if cfg.model.tiled_mlp:
        check_tiled_mlp(skeleton)
    router_loss = resolve_router_loss(cfg.model, cfg.parallel, model_config, skeleton)
    if cfg.peft.use_peft:
        if cfg.peft.load_in_4bit:
            check_qlora(cfg, ds, hardware)
        check_lora(cfg.peft, skeleton, hardware.accelerator, router_loss is not None)
    return router_loss
