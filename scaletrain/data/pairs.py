"""Preference pairs read back from a preference store for training: pair i of a split is its sequences 2i (prompt +
chosen) and 2i + 1 (prompt + rejected). A pair plays the part of a block, so a pair's two sequences share a micro-batch:
B chosen rows then B rejected (TRL's order), right-padded (causal attention never looks ahead at the padding), or with
--padding_free one row with `token_rows` naming each token's sequence. `targets_in` counts pairs, so the loop's
normaliser makes the loss the mean over the global batch's pairs on any number of ranks. Truncation keeps the
completion, which the loss compares, whole. Reference log-probs travel as `ref_chosen_logps` / `ref_rejected_logps`.
ORPO's NLL term is over whole chosen sequences, prompts included (TRL's): each batch carries their targets
(`sequence_labels`, padding-free `sequence_shift_labels`), and `step_fields` gives every micro-batch of a step the
global batch's pair and chosen-target counts, so that term is the token mean over the global batch on any layout.
Formats and batches: docs/fine-tuning.md#preference-optimization-dpo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from scaletrain.data.blocks import EMPTY_SLOT, IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass
class PreferencePairs:
    tokens: np.ndarray  # flat token ids of every sequence (a memmap of the store)
    mask: np.ndarray  # 1 on completion tokens
    starts: np.ndarray  # each sequence's first token in `tokens`, after truncation
    lengths: np.ndarray  # each sequence's length, after truncation
    completion_at: np.ndarray  # where each sequence's completion starts, counted from its (truncated) start
    kept: np.ndarray  # the split's pair numbers left after --truncation drop, in order
    block_size: int
    pad_id: int
    truncated: int = 0  # sequences cut to the block
    dropped: int = 0  # pairs left out
    ref_logps: np.ndarray | None = None  # [pairs of the split, 2]: the reference's chosen / rejected log-probs
    padding_free: bool = False  # each micro-batch as one row of its sequences end to end
    isolate_documents: bool = False  # padded rows, or packed with position ids restarting: nothing else to isolate
    unit: str = field(default="pairs", init=False)

    def __len__(self) -> int:
        return len(self.kept)

    @property
    def n_split_pairs(self) -> int:
        """Pairs of the split, those --truncation drop left out included (the reference arrays' length)."""
        return len(self.starts) // 2

    @property
    def n_tokens(self) -> int:
        rows = np.concatenate([2 * self.kept, 2 * self.kept + 1])
        return int(self.lengths[rows].sum())

    @property
    def n_documents(self) -> int:
        return len(self.kept)

    @property
    def last_block_length(self) -> int:
        return self.block_size

    def targets_in(self, indices: np.ndarray) -> int:
        """The loss normaliser's count: the real pairs among `indices` (the loss is a mean over pairs)."""
        return int((indices != EMPTY_SLOT).sum())

    def tokens_in(self, indices: np.ndarray) -> int:
        """Real tokens of the given pairs (both sequences, prompts included): what their forward processes, the
        step's throughput."""
        real = self.kept[indices[indices != EMPTY_SLOT]]
        return int(self.lengths[np.concatenate([2 * real, 2 * real + 1])].sum())

    def sequence_targets_in(self, indices: np.ndarray) -> int:
        """Next-token targets of the given pairs' whole chosen sequences (every token but the first): the token count
        of ORPO's NLL term."""
        real = self.kept[indices[indices != EMPTY_SLOT]]
        return int(np.maximum(self.lengths[2 * real] - 1, 0).sum())

    def step_fields(self, indices: np.ndarray) -> dict:
        """What every micro-batch of a step (or an evaluation set) carries about the whole of it, `indices` its
        pairs: their count and the targets of their chosen sequences."""
        import torch

        return {
            "step_pairs": torch.tensor(self.targets_in(indices), dtype=torch.float64),
            "step_sequence_targets": torch.tensor(self.sequence_targets_in(indices), dtype=torch.float64),
        }

    def batch(self, indices: np.ndarray) -> dict:
        """2B rows for B pair indices (EMPTY_SLOT: a pair of padding rows with no loss): chosen rows, then rejected."""
        import torch

        real = indices != EMPTY_SLOT
        pairs = np.where(real, self.kept[np.where(real, indices, 0)], -1)
        rows = [2 * p if p >= 0 else -1 for p in pairs] + [2 * p + 1 if p >= 0 else -1 for p in pairs]
        batch = self._packed(rows) if self.padding_free else self._padded(rows)
        batch["pair_ids"] = torch.from_numpy(pairs.astype(np.int64))
        if self.ref_logps is not None:
            ref = np.where(real[:, None], self.ref_logps[np.maximum(pairs, 0)], 0.0)
            batch["ref_chosen_logps"] = torch.from_numpy(ref[:, 0].astype(np.float64))
            batch["ref_rejected_logps"] = torch.from_numpy(ref[:, 1].astype(np.float64))
        return batch

    def _sequence(self, row: int) -> tuple:
        """(token ids, the label of each: the token on completion tokens, IGNORE_INDEX on the prompt)."""
        start, n, at = int(self.starts[row]), int(self.lengths[row]), int(self.completion_at[row])
        ids = np.asarray(self.tokens[start : start + n], dtype=np.int64)
        labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
        labels[at:] = ids[at:]
        return ids, labels

    def _padded(self, rows: list) -> dict:
        """One row per sequence, right-padded to the longest (a missing row: padding with no loss)."""
        import torch

        width = max([int(self.lengths[r]) for r in rows if r >= 0] or [2])
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        whole = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)  # chosen rows: every token a label
        for k, r in enumerate(rows):
            if r >= 0:
                seq_ids, seq_labels = self._sequence(r)
                ids[k, : len(seq_ids)], labels[k, : len(seq_ids)] = seq_ids, seq_labels
                if r % 2 == 0:
                    whole[k, : len(seq_ids)] = seq_ids
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "sequence_labels": torch.from_numpy(whole),
        }

    def _packed(self, rows: list) -> dict:
        """One row of the sequences end to end: positions restart at each, targets are shifted within each (a
        sequence's last token predicts nothing), `token_rows` names each token's sequence k (its row in the padded
        layout; -1 on the two padding tokens of a micro-batch without any pair)."""
        import torch

        ids, targets, whole, positions, owners = [], [], [], [], []
        for k, r in enumerate(rows):
            if r < 0:
                continue
            seq_ids, seq_labels = self._sequence(r)
            ids.append(seq_ids)
            targets.append(np.append(seq_labels[1:], IGNORE_INDEX))
            chosen = r % 2 == 0  # whole chosen sequences: ORPO's NLL targets
            whole.append(np.append(seq_ids[1:], IGNORE_INDEX) if chosen else np.full(len(seq_ids), IGNORE_INDEX))
            positions.append(np.arange(len(seq_ids), dtype=np.int64))
            owners.append(np.full(len(seq_ids), k, dtype=np.int64))
        if not ids:  # every slot empty: two tokens of padding, no loss
            ids, targets = [np.full(2, self.pad_id, dtype=np.int64)], [np.full(2, IGNORE_INDEX, dtype=np.int64)]
            whole = [np.full(2, IGNORE_INDEX, dtype=np.int64)]
            positions, owners = [np.arange(2, dtype=np.int64)], [np.full(2, -1, dtype=np.int64)]
        flat = lambda parts: torch.from_numpy(np.concatenate(parts))[None]  # noqa: E731
        return {
            "input_ids": flat(ids),
            "shift_labels": flat(targets),
            "sequence_shift_labels": flat(whole),
            "position_ids": flat(positions),
            "token_rows": flat(owners)[0],
        }


def pairs_from_store(
    opened: dict, *, split: str, block_size: int, truncation: str, padding_free: bool = False
) -> PreferencePairs | None:
    """The pairs of one split of a preference store, with --truncation applied; None when no pair is left."""
    part = opened["splits"].get(split)
    if part is None or part.n_tokens == 0:
        return None
    mask = opened["masks"][split]
    starts = np.asarray(part.doc_starts, dtype=np.int64)
    ends = np.concatenate([starts[1:], [len(part.tokens)]]).astype(np.int64)
    full = ends - starts
    trained = np.flatnonzero(np.asarray(mask))  # the first trained token of a sequence starts its completion
    prompt = trained[np.searchsorted(trained, starts)] - starts
    over = np.maximum(full - block_size, 0)
    too_long = over > 0
    pair_too_long = too_long[0::2] | too_long[1::2]
    if truncation == "drop":
        kept = np.flatnonzero(~pair_too_long)
        cut = np.zeros_like(over)
    else:
        kept = np.arange(len(starts) // 2)
        cut = np.minimum(over, prompt)  # the prompt's first tokens go first
    lengths = np.minimum(full - cut, block_size)
    pairs = PreferencePairs(
        part.tokens,
        mask=np.asarray(mask),
        starts=starts + cut,
        lengths=lengths,
        completion_at=prompt - cut,
        kept=kept,
        block_size=block_size,
        pad_id=opened["manifest"]["pad_id"],
        truncated=int(too_long.sum()) if truncation == "truncate" else 0,
        dropped=int(pair_too_long.sum()) if truncation == "drop" else 0,
        padding_free=padding_free,
    )
    if not len(pairs):
        return None
    log.info(
        f"preference data ({split}): {len(pairs)} pairs; {pairs.truncated + pairs.dropped} "
        f"{'sequences' if truncation == 'truncate' else 'pairs'} longer than the block "
        f"{'truncated to it (prompt first)' if truncation == 'truncate' else 'dropped'}"
    )
    return pairs


def print_pairs(pairs: PreferencePairs, n: int, tokenizer) -> None:
    """--print_samples N on preference data: the first N pairs as trained, each completion's tokens marked."""
    from scaletrain.data.chat_render import format_sample

    for shown, pair in enumerate(pairs.kept[:n]):
        for side, row in (("chosen", 2 * pair), ("rejected", 2 * pair + 1)):
            start, length, at = int(pairs.starts[row]), int(pairs.lengths[row]), int(pairs.completion_at[row])
            ids = pairs.tokens[start : start + length].tolist()
            mask = [0] * at + [1] * (length - at)
            log.info(
                f"sample {shown + 1} (pair {pair}, {side}, {length} tokens, {length - at} trained):\n"
                f"{format_sample(ids, mask, tokenizer)}"
            )
