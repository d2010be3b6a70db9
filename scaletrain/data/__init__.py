"""Data: raw sources -> token and chat stores (prepared once, fingerprinted) -> packed blocks -> the global sampling
order each rank reads from.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.data.blocks import EMPTY_SLOT, EvalBatches, IGNORE_INDEX, PackedBlocks
from scaletrain.data.chat_store import attach_masks, store_plan
from scaletrain.data.checks import check_block_size, check_data_source
from scaletrain.data.preparation import ensure_token_store
from scaletrain.data.sampling import BatchRamp, GlobalOrder, StepBatches
from scaletrain.data.token_store import open_store, tokenizer_hash
from scaletrain.data.training_data import describe_data, training_blocks, validation_sets

__all__ = [
    "BatchRamp",
    "EMPTY_SLOT",
    "EvalBatches",
    "GlobalOrder",
    "IGNORE_INDEX",
    "PackedBlocks",
    "StepBatches",
    "attach_masks",
    "check_block_size",
    "check_data_source",
    "describe_data",
    "ensure_token_store",
    "open_store",
    "store_plan",
    "tokenizer_hash",
    "training_blocks",
    "validation_sets",
]
