"""Packed blocks: a token store's stream cut into fixed-size training blocks, several stores mixed by weight, and the
fixed evaluation set. The last, partial block is padded and masked instead of dropped, so every token is trained on each
epoch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100  # label value the loss skips (padding), as in Hugging Face
EMPTY_SLOT = -1  # a micro-batch row with no block: the epoch's last global batch ran out of blocks


@dataclass
class PackedBlocks:
    """A token stream (documents joined with EOS) cut into `block_size` blocks; nothing is copied or dropped. With
    isolate_documents, position ids restart at every document (and block) start, which transformers turns into a
    block-diagonal causal mask.
    """

    stream: np.ndarray  # flat token ids, usually a read-only memmap of a token store
    doc_starts: np.ndarray  # offset of each document's first token in the stream
    block_size: int
    pad_id: int
    isolate_documents: bool = False

    def __len__(self) -> int:
        return math.ceil(len(self.stream) / self.block_size)

    @property
    def n_tokens(self) -> int:
        return len(self.stream)

    @property
    def n_documents(self) -> int:
        return len(self.doc_starts)

    @property
    def last_block_length(self) -> int:
        return len(self.stream) - (len(self) - 1) * self.block_size

    def lengths_of(self, indices: np.ndarray) -> np.ndarray:
        return np.where(indices == len(self) - 1, self.last_block_length, self.block_size)

    def targets_in(self, indices: np.ndarray) -> int:
        """Tokens the loss is computed on: every real token but the first of its block (it has no prefix)."""
        real = indices[indices != EMPTY_SLOT]
        return int(np.maximum(self.lengths_of(real) - 1, 0).sum())

    def _position_ids(self, start: int) -> np.ndarray:
        positions = np.arange(start, start + self.block_size)
        owner = np.searchsorted(self.doc_starts, positions, side="right") - 1
        return positions - np.maximum(self.doc_starts[np.maximum(owner, 0)], start)

    def batch(self, indices: np.ndarray) -> dict:
        """Tensors for the given block indices; EMPTY_SLOT rows are all padding and carry no loss."""
        return padded_batch(
            indices,
            block_size=self.block_size,
            pad_id=self.pad_id,
            fill_row=self._fill_row,
            with_positions=self.isolate_documents,
        )

    def _fill_row(self, index: int, ids: np.ndarray, labels: np.ndarray, positions: np.ndarray) -> None:
        """Block `index` into one padded row: its tokens are trained on as they are."""
        b = self.block_size
        chunk = self.stream[index * b : (index + 1) * b]
        ids[: len(chunk)] = chunk
        labels[: len(chunk)] = chunk
        if self.isolate_documents:
            positions[:] = self._position_ids(index * b)


def padded_batch(indices: np.ndarray, *, block_size: int, pad_id: int, fill_row, with_positions: bool) -> dict:
    """The tensors of a micro-batch of blocks, shared by every kind of blocks: each row starts as padding with no
    loss and positions 0..block_size-1; fill_row(index, ids, labels, positions) writes block `index` into its row
    (numpy views, in place). EMPTY_SLOT rows stay padding. position_ids only `with_positions`."""
    import torch

    rows = np.full((len(indices), block_size), pad_id, dtype=np.int64)
    labels = np.full((len(indices), block_size), IGNORE_INDEX, dtype=np.int64)
    positions = np.tile(np.arange(block_size), (len(indices), 1))
    for row, index in enumerate(indices):
        if index != EMPTY_SLOT:
            fill_row(int(index), rows[row], labels[row], positions[row])
    batch = {"input_ids": torch.from_numpy(rows), "labels": torch.from_numpy(labels)}
    if with_positions:
        batch["position_ids"] = torch.from_numpy(positions)
    return batch


def blocks_from_store(opened: dict, split: str, block_size: int, isolate_documents: bool) -> PackedBlocks | None:
    part = opened["splits"].get(split)
    if part is None or part.n_tokens == 0:
        return None
    return PackedBlocks(
        part.tokens,
        doc_starts=part.doc_starts,
        block_size=block_size,
        pad_id=opened["manifest"]["pad_id"],
        isolate_documents=isolate_documents,
    )


class EvalBatches(Sequence):
    """This rank's evaluation micro-batches, each built when read from the store's memory map: only block indices
    are held, never the split as tensors (at scale the held-out split alone is gigabytes of int64 per rank)."""

    def __init__(self, parts: list, batch_size: int):
        self.batch_size = batch_size
        # (blocks, indices of one micro-batch) per batch, in reading order
        self._batches = [
            (blocks, mine[i : i + batch_size]) for blocks, mine in parts for i in range(0, len(mine), batch_size)
        ]

    @classmethod
    def chain(cls, several: list) -> EvalBatches:
        """One sequence of the batches of several stores' sets, in order."""
        out = cls([], several[0].batch_size if several else 1)
        out._batches = [entry for batches in several for entry in batches._batches]
        return out

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        blocks, indices = self._batches[i]
        return blocks.batch(indices)

    def rows(self, i: int) -> int:
        """Rows of batch i, without building it (the last batch of a set may be smaller)."""
        return len(self._batches[i][1])

    def sources(self) -> list:
        """The distinct blocks objects the batches read from, in order."""
        return list({id(blocks): blocks for blocks, _ in self._batches}.values())

    def targets(self) -> int:
        """Loss targets over all the batches, from the block lengths alone."""
        return sum(blocks.targets_in(indices) for blocks, indices in self._batches)

    def step_fields(self) -> dict | None:
        """The sums over all the batches of their blocks' step_fields (preference pairs: pair and chosen-target
        counts), from the lengths alone; None where the blocks have none."""
        fields = [blocks.step_fields(indices) for blocks, indices in self._batches if hasattr(blocks, "step_fields")]
        if not fields:
            return None
        return {name: sum(f[name] for f in fields) for name in fields[0]}


def eval_batches(blocks: PackedBlocks, *, batch_size: int, rank: int, world: int, limit: int | None) -> EvalBatches:
    """A fixed set of validation blocks (the first `limit`, in order), split across ranks, read lazily. Every rank
    gets the same number of batches (short ranks get EMPTY_SLOT rows): under ZeRO-3 each forward is a collective.
    """
    n = len(blocks) if limit is None else min(limit, len(blocks))
    per_rank = math.ceil(n / world)
    mine = np.full(per_rank, EMPTY_SLOT, dtype=np.int64)
    owned = np.arange(rank, n, world)
    mine[: len(owned)] = owned
    return EvalBatches([(blocks, mine)], batch_size)


def smooth_schedule(weights: list, period: int) -> np.ndarray:
    """Source of each slot in a period, interleaved as evenly as the weights allow (smooth weighted round robin)."""
    credit = np.zeros(len(weights))
    slots = np.empty(period, dtype=np.int64)
    for slot in range(period):
        credit += weights
        k = int(np.argmax(credit))
        slots[slot] = k
        credit[k] -= 1.0
    return slots


@dataclass
class MixedBlocks:
    """Blocks of several stores in one index space, drawn in fixed proportions, deterministically: index j's slot
    j % P in a smooth schedule of P slots names the source, O(1) in j. A source read past its end starts a fresh
    permutation (seeded by seed, source and cycle), so a small source is upsampled without repeating a fixed order.
    """

    sources: list
    weights: list
    seed: int
    period: int = 1000

    def __post_init__(self) -> None:
        self.schedule = smooth_schedule(self.weights, self.period)
        self.per_period = np.bincount(self.schedule, minlength=len(self.sources))
        self.rank_in_period = np.zeros(self.period, dtype=np.int64)
        seen = np.zeros(len(self.sources), dtype=np.int64)
        for slot, k in enumerate(self.schedule):
            self.rank_in_period[slot] = seen[k]
            seen[k] += 1
        self._cycles: dict = {}
        self.block_size = self.sources[0].block_size
        self.isolate_documents = self.sources[0].isolate_documents

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)  # an epoch draws as many blocks as the sources hold

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.sources)

    @property
    def n_documents(self) -> int:
        return sum(s.n_documents for s in self.sources)

    @property
    def last_block_length(self) -> int:
        return self.sources[-1].last_block_length

    def locate(self, j: int) -> tuple:
        """(source, block index in that source) of mixed sample j."""
        period, slot = divmod(int(j), self.period)
        k = int(self.schedule[slot])
        local = period * int(self.per_period[k]) + int(self.rank_in_period[slot])
        cycle, position = divmod(local, len(self.sources[k]))
        key = (k, cycle)
        if key not in self._cycles:
            if len(self._cycles) > 64:
                self._cycles.clear()
            self._cycles[key] = np.random.default_rng([self.seed, k, cycle]).permutation(len(self.sources[k]))
        return k, int(self._cycles[key][position])

    def _split(self, indices: np.ndarray) -> list:
        return [(row, *self.locate(j)) for row, j in enumerate(indices) if j != EMPTY_SLOT]

    def targets_in(self, indices: np.ndarray) -> int:
        return sum(self.sources[k].targets_in(np.array([b])) for _, k, b in self._split(indices))

    def batch(self, indices: np.ndarray) -> dict:
        out = self.sources[0].batch(np.full(len(indices), EMPTY_SLOT))
        for row, k, block in self._split(indices):
            one = self.sources[k].batch(np.array([block]))
            for key in out:
                out[key][row] = one[key][0]
        return out
