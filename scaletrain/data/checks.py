"""The data's pre-flight: where the documents come from and the block size they are cut into, checked before
anything is prepared or built (a mistake ends the run with exit code 2)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.config import DataArgs
from scaletrain.data.chat_store import resolve_chat_data
from scaletrain.data.raw import check_data_files
from scaletrain.data.token_store import read_manifest, tokenizer_hash
from scaletrain.errors import UsageError


def check_data_source(data: DataArgs, tokenizer, reads_first_row: bool):
    """Chat data (its template and loss mode: chat_store.ChatData) or None for text, whose files are checked here.
    The export carries the template the model was trained with, so the tokenizer takes it."""
    chat = resolve_chat_data(data, tokenizer, reads_first_row=reads_first_row)
    if chat is None:
        check_data_files(data)
    elif chat.template is not None:
        tokenizer.chat_template = chat.template.text
    return chat


def check_block_size(data: DataArgs, tokenizer_source: str, tokenizer, max_positions: int) -> int:
    """The block size the run trains on: a prepared store's own, --block_size, or min(1024, the model's positions)."""
    return _block_size(data, max_positions, _check_stores(data, tokenizer_source, tokenizer))


def _check_stores(data: DataArgs, tokenizer_source: str, tokenizer) -> int | None:
    """Prepared stores must have been made with this run's tokenizer and one block size. Returns that size."""
    sizes = set()
    flag = data.store_flag
    for path in data.store_paths:
        fingerprint = read_manifest(Path(path))["fingerprint"]
        if fingerprint["tokenizer_sha256"] != tokenizer_hash(tokenizer):
            raise UsageError(
                f"{flag} {path}: prepared with a different tokenizer than {tokenizer_source}",
                "prepare the store with this run's --tokenizer_name",
            )
        if data.block_size is not None and data.block_size != fingerprint["block_size"]:
            raise UsageError(
                f"--block_size {data.block_size}: the store {path} was prepared for block size "
                f"{fingerprint['block_size']}",
                "drop --block_size, or prepare a store for this size",
            )
        sizes.add(fingerprint["block_size"])
    if len(sizes) > 1:
        raise UsageError(
            f"--dataset_mix: the stores have different block sizes ({sorted(sizes)})",
            "prepare every store with the same --block_size",
        )
    return sizes.pop() if sizes else None


def _block_size(data: DataArgs, limit: int, store_block_size: int | None) -> int:
    if store_block_size is not None:
        if store_block_size > limit:
            raise UsageError(
                f"{', '.join(data.store_paths)}: block size {store_block_size} is above the model's "
                f"maximum positions ({limit})",
                f"prepare a store with --block_size {limit} or less",
            )
        return store_block_size
    if data.block_size is None:
        return min(1024, limit)
    if data.block_size > limit:
        raise UsageError(
            f"--block_size {data.block_size}: above the model's maximum positions ({limit})",
            f"use --block_size {limit} or less",
        )
    return data.block_size
