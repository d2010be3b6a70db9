"""What the loop reads, assembled from opened stores: the training blocks (several stores mixed by weight), the
global order and the LR schedule's length, the fixed evaluation sets, and the one line that says how the data was
cut into the global batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.config import VALIDATION_SPLIT, DataArgs, ResolvedDSConfig, RunConfig, eval_metric_prefix
from scaletrain.data.blocks import EvalBatches, MixedBlocks, eval_batches
from scaletrain.data.packing import PackedExamples, blocks_for, print_samples
from scaletrain.data.pairs import PreferencePairs, print_pairs
from scaletrain.data.sampling import BatchRamp, GlobalOrder
from scaletrain.engine import describe_schedule_change, schedule_for
from scaletrain.errors import UsageError
from scaletrain.logs import interactive
from scaletrain.parts import DistInfo, ResumePoint

if TYPE_CHECKING:
    from scaletrain.data.blocks import PackedBlocks
    from scaletrain.data.chat_store import ChatData
    from scaletrain.engine import LRSchedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingData:
    """What the loop reads: opened token stores, packed training blocks, the evaluation sets, the global order of
    the blocks (with any batch ramp-up) and the LR schedule's length."""

    stores: tuple  # opened token stores ({"path", "splits", ...}), in --dataset_mix order
    blocks: PackedBlocks
    eval_sets: dict  # {validation split: EvalBatches}
    order: GlobalOrder
    schedule: LRSchedule


def training_blocks(stores: list, *, data: DataArgs, block_size: int, seed: int, tokenizer):
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
                eval_batches(blocks, batch_size=batch_size, rank=dp_rank, world=dp_world_size, limit=max_samples)
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


def describe_data(blocks, *, order, micro: int, accumulation: int, dp_world_size: int, total_steps: int) -> str:
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


def prepare_stores(cfg: RunConfig, *, dist: DistInfo, tokenizer, block_size: int, chat: ChatData | None) -> tuple:
    """The opened token stores: --data_path or --dataset_mix as given, or the raw data prepared once (local rank 0
    of each node prepares; the others wait on the file system, with a way out if it fails or dies). `chat`: chat or
    preference data's template and loss mode (None: plain text)."""
    from scaletrain.data.chat_store import attach_masks, store_plan
    from scaletrain.data.preparation import ensure_store, ensure_token_store
    from scaletrain.data.token_store import open_store

    show_progress = dist.is_main and interactive()  # in a redirect, the log line of each store says it
    paths = [Path(p) for p in cfg.data.store_paths]
    if not paths and chat is not None:  # chat data: tokens and a loss mask
        store, prepare = store_plan(
            cfg.data, tokenizer=tokenizer, block_size=block_size, chat=chat, show_progress=show_progress
        )
        paths = [ensure_store(store, dist.local_rank, prepare)]
    elif not paths:
        paths = [
            ensure_token_store(
                cfg.data,
                tokenizer=tokenizer,
                tokenizer_dir=cfg.model.tokenizer_source,
                block_size=block_size,
                local_rank=dist.local_rank,
                show_progress=show_progress,
                seed=cfg.optim.seed,
            )
        ]
    stores = tuple(attach_masks(open_store(path), path) for path in paths)  # chat data: each store's masks
    log.info("token store(s): %s", ", ".join(map(str, paths)))
    return stores


def build_training_data(
    stores: tuple,
    *,
    cfg: RunConfig,
    ds: ResolvedDSConfig,
    dist: DistInfo,
    block_size: int,
    tokenizer,
    resume: ResumePoint | None,
) -> TrainingData:
    """Packed blocks from the stores, the global order with this run's batch sizes (an explicit JSON value stands
    where the flag was not typed) from the resume point on, the LR schedule's length and the evaluation sets."""
    layout = dist.layout
    data, optim = cfg.data, cfg.optim
    blocks = training_blocks(list(stores), data=data, block_size=block_size, seed=optim.seed, tokenizer=tokenizer)
    micro, accumulation = ds.micro_batch, ds.config["gradient_accumulation_steps"]
    resumed = resume.state if resume else {}
    ramp = optim.rampup_batch_size and BatchRamp(*optim.rampup_batch_size, full=micro * accumulation * layout.dp)
    order = GlobalOrder(
        len(blocks),
        micro_batch=micro,
        accumulation=accumulation,
        dp_world_size=layout.dp,
        seed=optim.seed,
        start_step=resumed.get("step", 0) + resumed.get("data_offset", 0),
        start_samples=resumed.get("samples_seen", 0),
        ramp=ramp or None,
    )
    total = optim.max_steps if optim.max_steps > 0 else order.total_steps(optim.num_train_epochs)
    schedule = schedule_for(
        optim.lr_scheduler_type,
        total_steps=total,
        warmup_steps=optim.warmup_steps,
        warmup_ratio=optim.warmup_ratio,
        min_lr_ratio=optim.min_lr_ratio,
        decay_ratio=optim.decay_ratio,
    )
    previous = resume and resume.previous_run_config
    changed = previous and describe_schedule_change(
        previous,
        schedule=schedule,
        peak_lr=ds.peak_lr,
        step=resumed.get("step", 0),
        skipped_steps=resumed.get("skipped_steps", 0),
    )
    if changed and dist.is_main:  # every rank computes the same: say it once
        log.warning(changed)
    eval_sets = validation_sets(
        list(stores),
        data=data,
        block_size=block_size,
        batch_size=optim.per_device_eval_batch_size,
        dp_rank=dist.coords.dp,
        dp_world_size=layout.dp,
        max_samples=cfg.logging.max_eval_samples,
    )
    log.info(
        describe_data(
            blocks, order=order, micro=micro, accumulation=accumulation, dp_world_size=layout.dp, total_steps=total
        )
    )
    if ramp:
        stages = ", ".join(f"{s.global_batch} from step {s.start_step}" for s in order.stages)
        log.info("batch ramp-up: %s", stages)
    return TrainingData(stores, blocks=blocks, eval_sets=eval_sets, order=order, schedule=schedule)
