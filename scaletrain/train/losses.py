"""The losses of one micro-batch: its summed token cross-entropy (through the chunked-loss head where the model has
one), and a mixture-of-experts model's load-balancing loss beside it. The loop's module docstring derives how they are
normalised."""

from __future__ import annotations

from scaletrain.data import IGNORE_INDEX


def token_loss_sum(engine, batch: dict):
    """Summed cross-entropy over the batch's real targets (labels shifted by one inside the block).

    With a chunked-loss head (scaletrain/model/chunked_loss.py, the default) the head computes it chunk by chunk and the
    whole logits never exist; with --loss_chunk_size 0 (or a model whose head cannot chunk) from the whole logits.
    """
    return _forward_losses(engine, batch)[0]


def token_and_router_losses(engine, batch: dict, router_loss) -> tuple:
    """(summed cross-entropy as token_loss_sum, the micro-batch's load-balancing loss): an MoE model's forward asked
    for its router logits."""
    summed, output = _forward_losses(engine, batch, output_router_logits=True)
    return summed, router_loss.aux_loss(output.router_logits, batch["labels"].to(engine.device, non_blocking=True))


def _forward_losses(engine, batch: dict, **forward_kwargs) -> tuple:
    """(summed cross-entropy, the model's output) of one micro-batch."""
    import torch.nn.functional as F

    from scaletrain.model import chunked_loss_head

    input_ids = batch["input_ids"].to(engine.device, non_blocking=True)
    # Padding sits only at the end of a block (right padding) and causal attention never looks ahead, so no
    # attention mask is needed: real tokens never see padding, and padded positions carry no loss.
    extra = {}
    if "position_ids" in batch:  # attention isolation: transformers masks attention per document from these
        extra["position_ids"] = batch["position_ids"].to(engine.device, non_blocking=True)
    if "shift_labels" in batch:  # a sequence-parallel shard: its labels were shifted over the whole block
        targets = batch["shift_labels"].to(engine.device, non_blocking=True)
    else:  # shift the labels, not the logits: slicing logits[:, :-1] would copy the largest activation of the step
        targets = F.pad(batch["labels"][:, 1:].to(engine.device, non_blocking=True), (0, 1), value=IGNORE_INDEX)
    extra.update(forward_kwargs)
    head = chunked_loss_head(engine.module)
    if head is not None:
        with head.pending(targets):
            output = engine(input_ids=input_ids, use_cache=False, **extra)
        head.check_returned(output.logits)
        return output.logits, output
    output = engine(input_ids=input_ids, use_cache=False, **extra)
    logits = output.logits
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    ), output
