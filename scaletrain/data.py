"""Raw documents -> token store (scaletrain.tokenstore) -> packed blocks -> a global order read by rank.

Packing joins every document with EOS and cuts the stream into `block_size` blocks; the last, partial block is
padded and masked instead of dropped, so every token of the corpus is trained on each epoch. The order of
blocks is a permutation drawn from (seed, epoch) over the whole corpus, independent of the world size; a global
batch is a contiguous run of that order, split into micro-batches by accumulation step and rank. Seeking to any
step is O(1): the batch of step s is computed from s, never by replaying the steps before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from scaletrain.config import LOCAL_DATA_FORMATS, RunConfig, UsageError, expand_data_files

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # label value the loss skips (padding), as in Hugging Face
EMPTY_SLOT = -1  # a micro-batch row with no block: the epoch's last global batch ran out of blocks


@dataclass
class PackedBlocks:
    """A token stream (documents joined with EOS) cut into `block_size` blocks; nothing is copied or dropped.

    Every block is full except the last, whose tail is padding that carries no loss. With isolate_documents,
    each row also gets position ids that restart at every document start (and at the block start), which
    transformers turns into a block-diagonal causal mask: no token attends across a document boundary.
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
        import torch

        b = self.block_size
        rows = np.full((len(indices), b), self.pad_id, dtype=np.int64)
        labels = np.full((len(indices), b), IGNORE_INDEX, dtype=np.int64)
        positions = np.tile(np.arange(b), (len(indices), 1))
        for row, index in enumerate(indices):
            if index == EMPTY_SLOT:
                continue
            chunk = self.stream[index * b: (index + 1) * b]
            rows[row, : len(chunk)] = chunk
            labels[row, : len(chunk)] = chunk
            if self.isolate_documents:
                positions[row] = self._position_ids(int(index) * b)
        batch = {"input_ids": torch.from_numpy(rows), "labels": torch.from_numpy(labels)}
        if self.isolate_documents:
            batch["position_ids"] = torch.from_numpy(positions)
        return batch


def _local_builder(files: list, flag: str) -> str:
    kinds = {LOCAL_DATA_FORMATS[Path(f).suffix.lower()] for f in files}
    if len(kinds) != 1:
        raise UsageError(f"--{flag}: files of different formats ({', '.join(sorted(kinds))})", "use one format")
    return kinds.pop()


def local_data_files(cfg: RunConfig) -> dict:
    """{split: [files]} of the run's local data (the built-in sample when no data flag is given)."""
    files = {"train": expand_data_files(cfg.train_data_file)}
    if cfg.validation_data_file:
        files["validation"] = expand_data_files(cfg.validation_data_file)
    return files


def _is_saved_dataset(path: str) -> bool:
    folder = Path(path)
    return folder.is_dir() and ((folder / "dataset_dict.json").exists() or (folder / "dataset_info.json").exists())


def load_raw_datasets(cfg: RunConfig):
    """Return (train, validation or None) as `datasets.Dataset`s of documents."""
    import datasets

    if cfg.dataset_name and _is_saved_dataset(cfg.dataset_name):
        raw = datasets.load_from_disk(cfg.dataset_name)
        raw = raw if isinstance(raw, datasets.DatasetDict) else datasets.DatasetDict({"train": raw})
    elif cfg.dataset_name:
        raw = datasets.load_dataset(cfg.dataset_name, cfg.dataset_config_name)
    else:
        files = local_data_files(cfg)
        builder = _local_builder([f for split in files.values() for f in split], "train_file/--validation_file")
        # Plain text: a blank line separates documents (one file may hold many; a paragraph is a document).
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, **extra)
    if "train" not in raw:
        raise UsageError(f"--dataset_name {cfg.dataset_name}: no train split (splits: {', '.join(raw)})")
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

    if cfg.dataset_name or cfg.data_path:
        return
    for flag, split_files in local_data_files(cfg).items():
        flag = "train_file" if flag == "train" else "validation_file"
        for path in split_files:
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
                detail = str(exc).splitlines()[0][:200] if str(exc) else "no detail"
                raise UsageError(f"--{flag} {path}: cannot read it as {builder} ({type(exc).__name__}: {detail})",
                                 "check the file's format and contents") from exc
            if first is None:
                raise UsageError(f"--{flag} {path}: the file holds no documents", "give a file with at least one")
            if cfg.text_column not in first:
                raise UsageError(f"--text_column {cfg.text_column}: not a column of {path}",
                                 f"columns there: {', '.join(first)}")
            if not isinstance(first[cfg.text_column], str):
                raise UsageError(f"--text_column {cfg.text_column}: holds {type(first[cfg.text_column]).__name__} "
                                 f"in {path}, not text", "pick a column of strings")


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
    # Where a resumed run picks up: its first step and the blocks consumed before it (the data position). With
    # the same global batch this gives the very batches of an uninterrupted run; with another one (a resume on a
    # different number of ranks) the current epoch's order continues from that position.
    start_step: int = 0
    start_samples: int = 0

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp_world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_blocks / self.global_batch)

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)

    def position(self, step: int) -> tuple:
        """(epoch, first position in that epoch's order) of optimizer step `step`; O(1)."""
        g = self.global_batch
        epoch0, offset0 = divmod(self.start_samples, self.n_blocks)
        k = step - self.start_step
        if offset0:
            first = math.ceil((self.n_blocks - offset0) / g)  # steps that finish the interrupted epoch
            if k < first:
                return epoch0, offset0 + k * g
            k, epoch0 = k - first, epoch0 + 1
        return epoch0 + k // self.steps_per_epoch, (k % self.steps_per_epoch) * g

    def total_steps(self, epochs: float) -> int:
        """The step at which `epochs` epochs of blocks have been trained."""
        epoch0, offset0 = divmod(self.start_samples, self.n_blocks)
        remaining = epochs - epoch0 - offset0 / self.n_blocks
        if remaining <= 0:
            return self.start_step
        steps = self.start_step
        if offset0:
            part = (self.n_blocks - offset0) / self.n_blocks
            if remaining <= part:
                return steps + math.ceil(remaining * self.n_blocks / self.global_batch)
            steps += math.ceil((self.n_blocks - offset0) / self.global_batch)
            remaining -= part
        return steps + math.ceil(round(remaining * self.steps_per_epoch, 9))

    def global_batch_indices(self, step: int, permutation: Optional[np.ndarray] = None) -> np.ndarray:
        """Block indices of optimizer step `step` (0-based), padded with EMPTY_SLOT to the global batch size."""
        epoch, lo = self.position(step)
        perm = self.epoch_permutation(epoch) if permutation is None else permutation
        chosen = perm[lo: lo + self.global_batch]
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

    def _global_indices(self, step: int) -> np.ndarray:
        epoch, _ = self.order.position(step)
        if epoch != self._epoch:
            self._epoch, self._permutation = epoch, self.order.epoch_permutation(epoch)
        return self.order.global_batch_indices(step, self._permutation)

    def for_step(self, step: int) -> tuple:
        global_indices = self._global_indices(step)
        # Every rank knows the whole global batch, so the loss normaliser needs no communication.
        global_targets = self.blocks.targets_in(global_indices)
        micro = [self.blocks.batch(idx) for idx in self.order.micro_batches(global_indices, self.rank)]
        n_blocks = int((global_indices != EMPTY_SLOT).sum())
        return micro, global_targets, n_blocks

    def sample_ids(self, step: int) -> list:
        """The global sample ids (block indices of the training order) of one step's whole global batch."""
        return [int(i) for i in self._global_indices(step) if i != EMPTY_SLOT]


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


# --- token stores: prepare once, reuse, open ------------------------------------------------------------------

STORE_CACHE_ENV = "SCALETRAIN_CACHE"


def store_fingerprint(cfg: RunConfig, tokenizer, block_size: int):
    from scaletrain.tokenstore import Fingerprint, source_identity, tokenizer_hash

    files = None if cfg.dataset_name else local_data_files(cfg)
    return Fingerprint(
        source=source_identity(files, cfg.dataset_name, cfg.dataset_config_name),
        tokenizer_sha256=tokenizer_hash(tokenizer),
        block_size=block_size,
        text_column=cfg.text_column,
        validation_split_percentage=cfg.validation_split_percentage,
    )


def default_store_path(fingerprint) -> Path:
    """Where raw data given to train.py is prepared: a cache keyed by the fingerprint, shared by runs."""
    root = Path(os.environ.get(STORE_CACHE_ENV, Path.home() / ".cache" / "scaletrain")) / "token_stores"
    key = hashlib.sha256(json.dumps(fingerprint.as_dict(), sort_keys=True).encode()).hexdigest()[:16]
    return root / key


def prepare_token_store(cfg: RunConfig, tokenizer, tokenizer_dir: str, block_size: int, store: Path,
                        num_proc: Optional[int], show_progress: bool = True) -> Path:
    """Tokenize the run's raw data into `store`, or reuse the store there when it was made from the same input."""
    from scaletrain.tokenstore import MANIFEST, read_manifest, write_store

    fingerprint = store_fingerprint(cfg, tokenizer, block_size)
    if (store / MANIFEST).exists():
        differs = fingerprint.differences(read_manifest(store)["fingerprint"])
        if not differs:
            log.info("token store %s: reusing it (same input, tokenizer and block size)", store)
            return store
        raise UsageError(f"{store}: holds a token store made from different input ({', '.join(differs)} differ)",
                         "choose another --output_dir, or delete that store")
    if store.exists() and (not store.is_dir() or any(store.iterdir())):
        raise UsageError(f"{store}: exists and is not a token store (no {MANIFEST}); nothing there was changed",
                         "choose a new or empty folder for the store")
    train, validation = load_raw_datasets(cfg)
    source = cfg.dataset_name or ", ".join(local_data_files(cfg)["train"])
    _check_text_column(train, cfg.text_column, source)
    if validation is not None:
        _check_text_column(validation, cfg.text_column, f"{source} (validation)")
    workers = num_proc or os.cpu_count() or 1
    started = time.perf_counter()
    write_store({"train": train, "validation": validation}, tokenizer, tokenizer_dir, fingerprint, store,
                num_proc=workers, show_progress=show_progress)
    log.info("token store %s: prepared in %.1fs, tokenizer parallelism %d", store, time.perf_counter() - started,
             workers)
    return store


def launch_identity() -> str:
    """The same for every local rank of one launch on a node, different for the next launch: the launcher process
    (deepspeed's launch.py, torchrun's agent, or srun's step daemon) and the restart counts of torchrun and Slurm."""
    env = os.environ
    return ":".join([str(os.getppid()), env.get("TORCHELASTIC_RESTART_COUNT", ""), env.get("SLURM_JOB_ID", ""),
                     env.get("SLURM_STEP_ID", ""), env.get("SLURM_RESTART_COUNT", "")])


def _read_failure(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none, or caught half-written: look again at the next poll
        return None


class TokenStoreFailed(RuntimeError):
    """Raised on a rank that waited for local rank 0 to prepare the token store, when that preparation failed."""


def ensure_token_store(cfg: RunConfig, tokenizer, tokenizer_dir: str, block_size: int, local_rank: int,
                       show_progress: bool) -> Path:
    """Raw data given to train.py: local rank 0 of each node prepares the store (under a file lock, so nodes
    sharing a file system prepare it once); the other ranks wait for its manifest by polling the file system,
    with no collective and so no timeout however long preparation takes. Runs before any process group exists.
    """
    import fcntl
    import socket

    from scaletrain.tokenstore import MANIFEST

    store = default_store_path(store_fingerprint(cfg, tokenizer, block_size))
    store.parent.mkdir(parents=True, exist_ok=True)
    # One marker per node: on a shared file system each node's local rank 0 reports to its own node's ranks.
    failed = store.parent / f"{store.name}.{socket.gethostname()}.failed"
    if local_rank == 0:
        with open(store.parent / f"{store.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            failed.unlink(missing_ok=True)
            try:
                return prepare_token_store(cfg, tokenizer, tokenizer_dir, block_size, store,
                                           cfg.preprocessing_num_workers, show_progress)
            except BaseException as err:
                # Tell the waiting ranks, which no launcher is bound to kill (srun without --kill-on-bad-exit).
                kind = "usage" if isinstance(err, UsageError) else "failed"
                failed.write_text(json.dumps({"launch": launch_identity(), "kind": kind,
                                              "error": str(err) or type(err).__name__}) + "\n")
                raise
    waited = 0.0
    while not (store / MANIFEST).exists():
        report = _read_failure(failed)
        if report is not None and report.get("launch") == launch_identity():  # not an earlier launch's failure
            if report["kind"] == "usage":
                raise UsageError(report["error"])
            raise TokenStoreFailed(f"local rank 0 could not prepare the token store {store}: {report['error']}")
        time.sleep(1.0)
        waited += 1.0
        if waited % 300 == 0:
            log.warning("still waiting for local rank 0 to prepare the token store %s (%.0f min)", store, waited / 60)
    return store


def blocks_from_store(opened: dict, split: str, block_size: int, isolate_documents: bool) -> Optional[PackedBlocks]:
    part = opened["splits"].get(split)
    if part is None or part.n_tokens == 0:
        return None
    return PackedBlocks(part.tokens, part.doc_starts, block_size, opened["manifest"]["pad_id"], isolate_documents)


# --- mixing several stores ------------------------------------------------------------------------------------

def parse_dataset_mix(value: str) -> list:
    """`path_a:0.7,path_b:0.3` -> [(path, weight)], weights normalised to sum to 1."""
    pairs = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        path, sep, weight = part.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not sep or not path or w <= 0:
            raise UsageError(f"--dataset_mix {value}: \"{part}\" is not path:weight with a positive weight",
                             "write it as store_a:0.7,store_b:0.3")
        pairs.append((path, w))
    if len(pairs) < 2:
        raise UsageError(f"--dataset_mix {value}: give at least two stores", "or use --data_path for one")
    total = sum(w for _, w in pairs)
    return [(path, w / total) for path, w in pairs]


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
    """Blocks of several stores in one index space, drawn in fixed proportions, deterministically.

    Index j falls in period j // P; the slot j % P names the source (a fixed smooth schedule of P slots), and
    the slot's rank among that source's slots gives the source-local sample number. A source read past its end
    starts a new cycle in a fresh permutation of its blocks (seeded by seed, source and cycle), so a small
    source is upsampled without repeating itself in a fixed order. Every lookup is O(1) in j.
    """

    sources: list
    weights: list
    seed: int
    period: int = 1000

    def __post_init__(self):
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
