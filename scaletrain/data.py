"""Raw text -> tokens -> packed blocks -> a global, seeded order read by data-parallel rank.

Packing joins every document with EOS and cuts the stream into `block_size` blocks; the last, partial block is
padded and masked instead of dropped, so every token of the corpus is trained on each epoch. The order of
blocks is a permutation drawn from (seed, epoch) over the whole corpus, independent of the world size; a global
batch is a contiguous run of that order, split into micro-batches by accumulation step and rank.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from scaletrain.config import LOCAL_DATA_FORMATS, RunConfig, UsageError

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # label value the loss skips (padding), as in Hugging Face
EMPTY_SLOT = -1  # a micro-batch row with no block: the epoch's last global batch ran out of blocks


@dataclass
class PackedBlocks:
    """A corpus cut into equal blocks. Only `lengths[i]` leading tokens of block i are real."""

    tokens: np.ndarray  # (n_blocks, block_size) int64
    lengths: np.ndarray  # (n_blocks,) real tokens per block
    n_documents: int
    pad_id: int

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def block_size(self) -> int:
        return self.tokens.shape[1]

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def targets_in(self, indices: np.ndarray) -> int:
        """Tokens the loss is computed on: every real token but the first of its block (it has no prefix)."""
        real = indices[indices != EMPTY_SLOT]
        return int(np.maximum(self.lengths[real] - 1, 0).sum())

    def batch(self, indices: np.ndarray) -> dict:
        """Tensors for the given block indices; EMPTY_SLOT rows are all padding and carry no loss."""
        import torch

        rows = np.full((len(indices), self.block_size), self.pad_id, dtype=np.int64)
        lengths = np.zeros(len(indices), dtype=np.int64)
        present = indices != EMPTY_SLOT
        rows[present] = self.tokens[indices[present]]
        lengths[present] = self.lengths[indices[present]]
        mask = np.arange(self.block_size)[None, :] < lengths[:, None]
        rows = np.where(mask, rows, self.pad_id)
        labels = np.where(mask, rows, IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(rows),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
            "labels": torch.from_numpy(labels),
        }


def _local_builder(files: list, flag: str) -> str:
    kinds = {LOCAL_DATA_FORMATS[Path(f).suffix.lower()] for f in files}
    if len(kinds) != 1:
        raise UsageError(f"--{flag}: files of different formats ({', '.join(sorted(kinds))})", "use one format")
    return kinds.pop()


def load_raw_datasets(cfg: RunConfig):
    """Return (train, validation or None) as `datasets.Dataset`s of documents."""
    import datasets

    if cfg.dataset_name:
        raw = datasets.load_dataset(cfg.dataset_name, cfg.dataset_config_name)
        if "train" not in raw:
            raise UsageError(f"--dataset_name {cfg.dataset_name}: no train split (splits: {', '.join(raw)})")
        train, validation = raw["train"], raw.get("validation")
    else:
        files = {"train": cfg.train_data_file}
        if cfg.validation_data_file:
            files["validation"] = cfg.validation_data_file
        builder = _local_builder(list(files.values()), "train_file/--validation_file")
        # Plain text: a blank line separates documents (one file may hold many; a paragraph is a document).
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, **extra)
        train, validation = raw["train"], raw.get("validation")
    if validation is None and cfg.validation_split_percentage > 0 and len(train) > 1:
        n_val = max(1, len(train) * cfg.validation_split_percentage // 100)
        validation = train.select(range(n_val))
        train = train.select(range(n_val, len(train)))
    return train, validation


def check_data_files(cfg: RunConfig) -> None:
    """Before anything is built: each local file has documents, and its --text_column exists and holds text.

    Reads only the first record, streaming (no Arrow cache is written). Hub datasets are checked when loaded.
    """
    import datasets

    if cfg.dataset_name:
        return
    for flag, path in (("train_file", cfg.train_data_file), ("validation_file", cfg.validation_data_file)):
        if path is None:
            continue
        builder = _local_builder([path], flag)
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        if not head.strip() and Path(path).stat().st_size <= len(head):
            raise UsageError(f"--{flag} {path}: the file holds no documents", "give a file with at least one")
        try:
            stream = datasets.load_dataset(builder, data_files={"train": path}, split="train", streaming=True,
                                           **extra)
            first = next(iter(stream), None)
        except Exception as exc:  # the readers raise many types; the user needs the file and the reason
            raise UsageError(f"--{flag} {path}: cannot read it as {builder} ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else 'no detail'})",
                             "check the file's format and contents") from exc
        if first is None:
            raise UsageError(f"--{flag} {path}: the file holds no documents", "give a file with at least one")
        if cfg.text_column not in first:
            raise UsageError(f"--text_column {cfg.text_column}: not a column of {path}",
                             f"columns there: {', '.join(first)}")
        if not isinstance(first[cfg.text_column], str):
            raise UsageError(f"--text_column {cfg.text_column}: holds {type(first[cfg.text_column]).__name__} in "
                             f"{path}, not text", "pick a column of strings")


def _check_text_column(ds, column: str, source: str) -> None:
    if len(ds) == 0:
        raise UsageError(f"{source}: the dataset is empty", "give a file or dataset with at least one document")
    if column not in ds.column_names:
        raise UsageError(
            f"--text_column {column}: not a column of {source}",
            f"columns there: {', '.join(ds.column_names)}",
        )
    feature = ds.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise UsageError(f"--text_column {column}: holds {feature}, not text", "pick a column of strings")


def tokenize_and_pack(ds, tokenizer, text_column: str, block_size: int, num_proc: Optional[int], source: str):
    """Tokenize every document, join them with EOS and cut into blocks; nothing is dropped."""
    _check_text_column(ds, text_column, source)
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        # verbose=False: documents longer than the model's context are expected; packing cuts them.
        ids = tokenizer([t or "" for t in batch[text_column]], add_special_tokens=True, verbose=False)["input_ids"]
        return {"input_ids": [x if (x and x[-1] == eos) else x + [eos] for x in ids]}

    tokenized = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
                       desc=f"tokenizing {source}")
    stream = np.fromiter(
        (t for doc in tokenized["input_ids"] for t in doc), dtype=np.int64
    )
    n_blocks = math.ceil(len(stream) / block_size)
    tokens = np.full(n_blocks * block_size, tokenizer.pad_token_id, dtype=np.int64)
    tokens[: len(stream)] = stream
    lengths = np.full(n_blocks, block_size, dtype=np.int64)
    lengths[-1] = len(stream) - (n_blocks - 1) * block_size
    return PackedBlocks(tokens.reshape(n_blocks, block_size), lengths, len(ds), tokenizer.pad_token_id)


@dataclass(frozen=True)
class GlobalOrder:
    """Which blocks make up each global batch, and which of them a rank reads at each accumulation step.

    The order depends on (seed, epoch) only, never on the world size: 1 rank with accumulation 4 and 2 ranks
    with accumulation 2 train on the same blocks in each step. The last global batch of an epoch holds the
    remaining blocks; the slots it cannot fill are EMPTY_SLOT (padding rows that carry no loss).
    """

    n_blocks: int
    micro_batch: int
    accumulation: int
    dp_world_size: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp_world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_blocks / self.global_batch)

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)

    def global_batch_indices(self, step: int, permutation: Optional[np.ndarray] = None) -> np.ndarray:
        """Block indices of optimizer step `step` (0-based), padded with EMPTY_SLOT to the global batch size."""
        epoch, within = divmod(step, self.steps_per_epoch)
        perm = self.epoch_permutation(epoch) if permutation is None else permutation
        chosen = perm[within * self.global_batch: (within + 1) * self.global_batch]
        padded = np.full(self.global_batch, EMPTY_SLOT, dtype=np.int64)
        padded[: len(chosen)] = chosen
        return padded

    def micro_batches(self, global_indices: np.ndarray, rank: int) -> list:
        """This rank's micro-batches of one global batch: micro-step k, rank r reads slot (k * dp + r)."""
        grid = global_indices.reshape(self.accumulation, self.dp_world_size, self.micro_batch)
        return [grid[k, rank] for k in range(self.accumulation)]


class StepBatches:
    """Yields, for each optimizer step, this rank's micro-batches and the global count of loss targets."""

    def __init__(self, blocks: PackedBlocks, order: GlobalOrder, rank: int):
        self.blocks = blocks
        self.order = order
        self.rank = rank
        self._epoch = -1
        self._permutation: Optional[np.ndarray] = None

    def for_step(self, step: int) -> tuple:
        epoch = step // self.order.steps_per_epoch
        if epoch != self._epoch:
            self._epoch, self._permutation = epoch, self.order.epoch_permutation(epoch)
        global_indices = self.order.global_batch_indices(step, self._permutation)
        # Every rank knows the whole global batch, so the loss normaliser needs no communication.
        global_targets = self.blocks.targets_in(global_indices)
        micro = [self.blocks.batch(idx) for idx in self.order.micro_batches(global_indices, self.rank)]
        n_blocks = int((global_indices != EMPTY_SLOT).sum())
        return micro, global_targets, n_blocks


def eval_batches(blocks: PackedBlocks, batch_size: int, rank: int, world: int, limit: Optional[int]) -> list:
    """A fixed set of validation blocks (the first `limit`, in order), split across ranks; same on every run.

    Every rank gets the same number of batches (short ranks get EMPTY_SLOT rows): under ZeRO-3 each forward
    is a collective, so ranks must run the same number of them.
    """
    n = len(blocks) if limit is None else min(limit, len(blocks))
    per_rank = math.ceil(n / world)
    mine = np.full(per_rank, EMPTY_SLOT, dtype=np.int64)
    owned = np.arange(rank, n, world)
    mine[: len(owned)] = owned
    return [blocks.batch(mine[i: i + batch_size]) for i in range(0, len(mine), batch_size)]
