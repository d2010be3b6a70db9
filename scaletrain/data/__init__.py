"""Data: raw sources -> token and chat stores (prepared once, fingerprinted) -> packed blocks -> the global sampling
order each rank reads from.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.data.blocks import EMPTY_SLOT, EvalBatches, IGNORE_INDEX
from scaletrain.data.chat_store import ChatData
from scaletrain.data.checks import check_block_size, check_data_source
from scaletrain.data.sampling import StepBatches
from scaletrain.data.token_store import tokenizer_hash
from scaletrain.data.training_data import TrainingData, build_training_data, prepare_stores

__all__ = [
    "TrainingData",
    "ChatData",
    "EMPTY_SLOT",
    "EvalBatches",
    "IGNORE_INDEX",
    "StepBatches",
    "build_training_data",
    "prepare_stores",
    "check_block_size",
    "check_data_source",
    "tokenizer_hash",
]
