"""What the loop reads, assembled from opened stores: the training blocks (several stores mixed by weight), the
fixed evaluation sets, and the one line that says how the data was cut into the global batch."""

from __future__ import annotations

import logging

from scaletrain.config import VALIDATION_SPLIT, DataArgs, eval_metric_prefix
from scaletrain.data.blocks import EvalBatches, MixedBlocks, eval_batches
from scaletrain.data.packing import PackedExamples, blocks_for, print_samples
from scaletrain.data.pairs import PreferencePairs, print_pairs
from scaletrain.errors import UsageError

log = logging.getLogger(__name__)


def training_blocks(stores: list, data: DataArgs, block_size: int, seed: int, tokenizer):
    """The blocks training draws from: one store's, or a --dataset_mix of several (chat data: whole examples);
    --print_samples shows the first store's first packed examples."""
    train = [blocks_for(s, "train", block_size, data) for s in stores]
    if any(t is None for t in train):
        raise UsageError(
            f"{data.data_path or data.dataset_mix or data.train_data_file or data.dataset_name}: no training tokens",
            "give data with at least one non-empty document",
        )
    if data.print_samples and isinstance(train[0], PackedExamples):
        print_samples(train[0], data.print_samples, tokenizer)
    elif data.print_samples and isinstance(train[0], PreferencePairs):
        print_pairs(train[0], data.print_samples, tokenizer)
    return MixedBlocks(train, [w for _, w in data.mix], seed) if data.mix else train[0]


def validation_sets(
    stores: list, data: DataArgs, block_size: int, batch_size: int, dp_rank: int, dp_world_size: int, max_samples
) -> dict:
    """{validation split: EvalBatches}: each set's blocks, the same fixed set on every run (each rank the same
    number of batches). A set that several stores hold (a --dataset_mix) is one set: their blocks in turn."""
    splits = dict.fromkeys(name for s in stores for name in s["splits"] if name.startswith(VALIDATION_SPLIT))
    sets = {}
    for split in splits:
        parts = [blocks_for(s, split, block_size, data) for s in stores if split in s["splits"]]
        batches = EvalBatches.chain(
            [
                eval_batches(blocks, batch_size, dp_rank, dp_world_size, max_samples)
                for blocks in parts
                if blocks is not None
            ]
        )
        if batches:
            sets[split] = batches
    if len(sets) > 1 or set(sets) - {VALIDATION_SPLIT}:
        log.info(
            "evaluation sets: %s",
            ", ".join(f"{eval_metric_prefix(split)}loss ({len(b)} batches per rank)" for split, b in sets.items()),
        )
    return sets


def describe_data(blocks, order, micro: int, accumulation: int, dp_world_size: int, total_steps: int) -> str:
    """The data line of a run's first logs: documents, tokens, blocks and how they make the global batch."""
    if getattr(blocks, "unit", None) == "pairs":
        return (
            f"data: {len(blocks)} preference pairs, {blocks.n_tokens} tokens (both sequences); global batch "
            f"{order.global_batch} pairs = {micro} micro x {accumulation} accumulation x {dp_world_size} ranks; "
            f"{order.steps_per_epoch} steps/epoch, {total_steps} steps"
        )
    return (
        f"data: {blocks.n_documents} documents, {blocks.n_tokens} tokens -> {len(blocks)} blocks of "
        f"{blocks.block_size} (last block {blocks.last_block_length} real tokens, padded; none dropped); global "
        f"batch {order.global_batch} blocks = {micro} micro x {accumulation} accumulation x {dp_world_size} ranks; "
        f"{order.steps_per_epoch} steps/epoch, {total_steps} steps"
    )
