"""Packing whole chat examples, so no conversation is cut at a block edge: best fit decreasing (TRL's "bfd") into
`block_size` blocks, position ids restarting at every example so that transformers masks attention per example (as for
--attention_isolation). Labels are the store's masked tokens, never an example's first (nothing in its example predicts
it). A block has PackedBlocks' batch() and targets_in(), so the loop stays the same. Truncation and what is tested:
docs/data.md#chat-data.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from scaletrain.data.blocks import EMPTY_SLOT, IGNORE_INDEX, blocks_from_store, padded_batch

log = logging.getLogger(__name__)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list:
    """Bins (lists of item indices) holding every item, each bin's lengths summing to at most `capacity`.
    Deterministic: longest first (ties by index), each into the bin with the least room that still fits it.
    Open bins are kept by their free room, and the distinct free-room values (at most capacity of them) in a
    sorted list, so an item costs one bisect."""
    assert all(0 < n <= capacity for n in lengths), "items must be non-empty and fit a bin"
    bins: list = []
    by_room: dict = defaultdict(list)  # free room -> open bins with that much room
    rooms: list = []  # the sorted free-room values that have open bins
    for item in np.argsort(-np.asarray(lengths), kind="stable"):
        need = int(lengths[item])
        k = bisect.bisect_left(rooms, need)
        if k == len(rooms):
            bins.append([])
            target, room = len(bins) - 1, capacity
        else:
            room = rooms[k]
            target = by_room[room].pop()
            if not by_room[room]:
                del rooms[k]
        bins[target].append(int(item))
        left = room - need
        if left:
            if not by_room[left]:
                bisect.insort(rooms, left)
            by_room[left].append(target)
    return bins


@dataclass
class PackedExamples:
    """Whole examples of a chat store packed into blocks; `bins[b]` holds the examples of block b."""

    tokens: np.ndarray  # flat token ids of every example (a memmap of the store)
    mask: np.ndarray  # 1 where a token is a loss target
    starts: np.ndarray  # each example's first token
    lengths: np.ndarray  # each example's length in its block (after truncation)
    bins: list
    block_size: int
    pad_id: int
    truncated: int = 0
    dropped: int = 0
    isolate_documents: bool = True  # always: examples never see each other
    bin_targets: np.ndarray = field(init=False)
    _n_tokens: int = field(init=False)

    def __post_init__(self):
        # Targets of an example: its masked tokens but the first (cumulative sums, no loop over tokens).
        trained = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])
        per_example = np.zeros(len(self.starts), dtype=np.int64)
        packed = np.array([e for b in self.bins for e in b], dtype=np.int64)
        if len(packed):
            s, n = self.starts[packed], self.lengths[packed]
            per_example[packed] = trained[s + n] - trained[s + 1]
        self.bin_targets = np.array([per_example[b].sum() for b in self.bins], dtype=np.int64)
        self._n_tokens = int(self.lengths[packed].sum())

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def n_documents(self) -> int:
        return sum(len(b) for b in self.bins)

    @property
    def last_block_length(self) -> int:
        return int(self.lengths[self.bins[-1]].sum()) if self.bins else 0

    def targets_in(self, indices: np.ndarray) -> int:
        real = indices[indices != EMPTY_SLOT]
        return int(self.bin_targets[real].sum())

    def batch(self, indices: np.ndarray) -> dict:
        """Tensors for the given block indices; EMPTY_SLOT rows are all padding and carry no loss."""
        return padded_batch(
            indices, block_size=self.block_size, pad_id=self.pad_id, fill_row=self._fill_row, with_positions=True
        )

    def _fill_row(self, index: int, row: np.ndarray, labels: np.ndarray, positions: np.ndarray) -> None:
        """The examples of block `index` one after the other into a padded row, each with its own positions."""
        at = 0
        for example in self.bins[index]:
            start, n = int(self.starts[example]), int(self.lengths[example])
            ids = self.tokens[start : start + n].astype(np.int64)  # a uint16 store cannot hold IGNORE_INDEX
            row[at : at + n] = ids
            trained = self.mask[start : start + n].astype(bool)
            trained[0] = False  # the first token of an example has no context in it
            labels[at : at + n] = np.where(trained, ids, IGNORE_INDEX)
            positions[at : at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(self.block_size - at)  # the padding is a sequence of its own


def pack_examples(tokens, *, mask, starts, block_size: int, pad_id: int, truncation: str) -> PackedExamples | None:
    """Best-fit packing of whole examples into blocks; None when no example is left to train on."""
    ends = np.concatenate([starts[1:], [len(tokens)]]).astype(np.int64)
    full = ends - np.asarray(starts, dtype=np.int64)
    too_long = full > block_size
    lengths = np.minimum(full, block_size)
    keep = np.flatnonzero((full > 0) & ~too_long) if truncation == "drop" else np.flatnonzero(full > 0)
    if len(keep) == 0:
        return None
    bins = [[int(keep[i]) for i in b] for b in best_fit_decreasing(lengths[keep], block_size)]
    return PackedExamples(
        tokens,
        mask=mask,
        starts=np.asarray(starts, dtype=np.int64),
        lengths=lengths,
        bins=bins,
        block_size=block_size,
        pad_id=pad_id,
        truncated=int(too_long.sum()) if truncation == "truncate" else 0,
        dropped=int(too_long.sum()) if truncation == "drop" else 0,
    )


def examples_from_store(opened: dict, split: str, block_size: int, truncation: str) -> PackedExamples | None:
    part = opened["splits"].get(split)
    if part is None or part.n_tokens == 0:
        return None
    packed = pack_examples(
        part.tokens,
        mask=opened["masks"][split],
        starts=part.doc_starts,
        block_size=block_size,
        pad_id=opened["manifest"]["pad_id"],
        truncation=truncation,
    )
    if packed is not None:
        fill = packed.n_tokens / (len(packed) * block_size)
        log.info(
            f"chat data ({split}): {packed.n_documents} examples packed whole into {len(packed)} blocks of {block_size}"
            f" ({100 * fill:.0f}% full, best fit); {packed.truncated + packed.dropped} longer than the block "
            f"{'truncated to it' if truncation == 'truncate' else 'dropped'}"
        )
    return packed


def blocks_for(opened: dict, split: str, block_size: int, data):
    """The blocks of one split of a store: preference pairs, whole examples for a chat store, the cut stream for
    plain text."""
    if opened["manifest"].get("chat_kind") == "preference":
        from scaletrain.data.pairs import pairs_from_store

        return pairs_from_store(
            opened, split=split, block_size=block_size, truncation=data.truncation, padding_free=data.padding_free
        )
    if "masks" in opened:
        return examples_from_store(opened, split, block_size, data.truncation)
    return blocks_from_store(opened, split, block_size, data.attention_isolation)


def print_samples(blocks: PackedExamples, n: int, tokenizer) -> None:
    """--print_samples N: the first N examples of the store, as rendered, their trained tokens marked."""
    from scaletrain.data.chat_render import format_sample

    for shown, example in enumerate(sorted(e for b in blocks.bins for e in b)[:n]):
        start, length = int(blocks.starts[example]), int(blocks.lengths[example])
        ids, mask = blocks.tokens[start : start + length], blocks.mask[start : start + length].copy()
        mask[0] = 0  # as batch() trains it
        log.info(
            f"sample {shown + 1} (example {example}, {length} tokens, {int(mask.sum())} trained):\n"
            f"{format_sample(ids.tolist(), mask.tolist(), tokenizer)}"
        )
