"""The model: tokenizer and model building (ZeRO-3 aware), LoRA and QLoRA, mixture-of-experts, the chunked loss.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.model.build import build_model, load_model_config, load_tokenizer, max_positions, meta_model
from scaletrain.model.checks import check_model_features, check_tokenizer_fits, describe_model
from scaletrain.model.chunked_loss import chunked_loss_head, chunked_token_loss, install_chunked_loss, logit_transforms
from scaletrain.model.lora import (
    apply_lora,
    base_identity,
    check_same_base,
    is_lora_model,
    load_adapter_state,
    merge_adapter,
    merged_dir,
    meta_lora_model,
    save_adapter,
)
from scaletrain.model.moe import RouterLoss, mark_leaf_modules
from scaletrain.model.qlora import build_qlora_model

__all__ = [
    "RouterLoss",
    "apply_lora",
    "base_identity",
    "build_model",
    "build_qlora_model",
    "check_model_features",
    "check_same_base",
    "check_tokenizer_fits",
    "chunked_loss_head",
    "chunked_token_loss",
    "describe_model",
    "install_chunked_loss",
    "is_lora_model",
    "load_adapter_state",
    "load_model_config",
    "logit_transforms",
    "meta_model",
    "load_tokenizer",
    "mark_leaf_modules",
    "max_positions",
    "merge_adapter",
    "merged_dir",
    "meta_lora_model",
    "save_adapter",
]
