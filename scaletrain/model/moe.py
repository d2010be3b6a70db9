"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): detection from the config keys transformers reads, the
router's load-balancing loss, and the expert blocks as ZeRO-3 leaf modules. The aux loss is transformers' own
`load_balancing_loss_func` on the returned router logits, padding left out of the router statistics (it is not data, and
would pull the balance toward the padding token's expert); without padding it equals the model's `aux_loss`. Under
ZeRO-3 a rank whose tokens reach no expert `e` would skip the gather of `e` that the other ranks wait on and hang the
run, so each block is a leaf, gathered whole on every rank. Details: docs/parallelism.md#mixture-of-experts-models.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING

from scaletrain.config import ModelArgs, ParallelArgs
from scaletrain.errors import UsageError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# model_type -> the class name of its sparse-MoE block (the ZeRO-3 leaf). A new MoE family adds a line here.
SPARSE_MOE_BLOCKS = {
    "mixtral": "MixtralSparseMoeBlock",
    "qwen2_moe": "Qwen2MoeSparseMoeBlock",
    "qwen3_moe": "Qwen3MoeSparseMoeBlock",
}


def _text_config(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def expert_count(model_config) -> int | None:
    """The number of routed experts of an MoE config; None for a dense model."""
    text = _text_config(model_config)
    if getattr(text, "router_aux_loss_coef", None) is None:
        return None
    for name in ("num_local_experts", "num_experts"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


@dataclass(frozen=True)
class RouterLoss:
    """How a run adds the router's load-balancing loss: coefficient, experts, top-k and transformers' function."""

    coef: float
    num_experts: int
    top_k: int
    balancing_loss: Callable[..., torch.Tensor]  # transformers' load_balancing_loss_func of the model's own module

    def aux_loss(self, router_logits: tuple, labels):
        """The micro-batch's load-balancing loss (a 0-dim fp32 tensor): router statistics over its real tokens.

        `labels` are the batch's unshifted labels, IGNORE_INDEX at padded positions; router_logits one
        [batch x sequence, experts] tensor per MoE layer, rows in the same order."""
        from scaletrain.data import IGNORE_INDEX

        real = labels != IGNORE_INDEX
        return self.balancing_loss(tuple(router_logits), self.num_experts, self.top_k, real)


def resolve_router_loss(args: ModelArgs, parallel: ParallelArgs, model_config, skeleton) -> RouterLoss | None:
    """The run's RouterLoss (None: a dense model, or --router_aux_loss_coef 0); UsageError for what is refused.

    `skeleton` is the meta-device model: the sparse-MoE block classes are looked up among its modules."""
    experts = expert_count(model_config)
    model_type = getattr(model_config, "model_type", type(model_config).__name__)
    if experts is None:
        if args.router_aux_loss_coef is not None:
            raise UsageError(
                f"--router_aux_loss_coef {args.router_aux_loss_coef}: {type(skeleton).__name__} "
                f"(model_type {model_type}) is not a mixture-of-experts model",
                "drop the flag",
            )
        return None
    for flag, size, why in (
        (
            "--pipeline_parallel_size",
            parallel.pipeline_parallel_size,
            "the pipe stages pass hidden states only, so the router logits (and the load-balancing loss) are lost",
        ),
        (
            "--tensor_parallel_size",
            parallel.tensor_parallel_size,
            "AutoTP does not split the experts' stacked 3-D weights, and the routing is untested under it",
        ),
        (
            "--sequence_parallel_size",
            parallel.sequence_parallel_size,
            "untested: each rank's router statistics would cover only its part of a block",
        ),
    ):
        if size > 1:
            raise UsageError(
                f"{flag} {size} with a mixture-of-experts model ({model_type}): not supported ({why})",
                "train it with data parallelism and ZeRO-1/2/3",
            )
    names = {type(module).__name__ for module in skeleton.modules()}
    known = SPARSE_MOE_BLOCKS.get(model_type)
    if known not in names:
        raise UsageError(
            f"{type(skeleton).__name__} (model_type {model_type}): a mixture-of-experts config, but no "
            f"known sparse-MoE block among its modules (known: {', '.join(SPARSE_MOE_BLOCKS.values())})",
            "add its block class to scaletrain/model/moe.py SPARSE_MOE_BLOCKS",
        )
    text = _text_config(model_config)
    coef = text.router_aux_loss_coef if args.router_aux_loss_coef is None else args.router_aux_loss_coef
    balancing_loss = getattr(inspect.getmodule(type(skeleton)), "load_balancing_loss_func", None)
    if balancing_loss is None:
        raise UsageError(
            f"{type(skeleton).__name__}: a mixture-of-experts model whose module has no load_balancing_loss_func",
            "add its aux-loss function to scaletrain/model/moe.py",
        )
    top_k = text.num_experts_per_tok
    source = "--router_aux_loss_coef" if args.router_aux_loss_coef is not None else "the model config"
    if coef == 0:
        log.info(
            "mixture of experts: %d experts, top-%d; no load-balancing loss (coefficient 0 from %s)",
            experts,
            top_k,
            source,
        )
        return None
    log.info(
        f"mixture of experts: {experts} experts, top-{top_k}; load-balancing loss x {coef:g} (from {source}), logged "
        "as aux_loss"
    )
    return RouterLoss(float(coef), experts, top_k, balancing_loss)


def mark_leaf_modules(model, model_config) -> None:
    """ZeRO-3: every sparse-MoE block of an MoE model becomes a leaf module (before deepspeed.initialize)."""
    if expert_count(model_config) is None:
        return
    from deepspeed.utils import set_z3_leaf_modules

    block = SPARSE_MOE_BLOCKS[model_config.model_type]  # resolve_router_loss checked it is there
    leaves = set_z3_leaf_modules(model, [block])
    log.info(
        "ZeRO-3 leaf modules: %d x %s (each block's experts are gathered together, whatever the routing)",
        len(leaves),
        block,
    )
