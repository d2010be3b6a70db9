"""The reference model's log-probabilities of every preference pair, computed once and reused
(--precompute_ref_log_probs, the default). A DPO run's reference is its starting model, which the engine is before the
first step, so the pass runs on the training engine itself (ZeRO-3: sharded, never a second copy of the weights; under
LoRA the zero-initialised adapter makes it the base, TRL's reference). The result is saved beside the store, keyed by
the starting model, precision and how the pairs were cut; a resumed run missing the file cannot recompute it (its engine
is no longer the starting model) and stops, saying so. Details: docs/fine-tuning.md#preference-optimization-dpo.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.data import EMPTY_SLOT
from scaletrain.distributed import any_rank, every_rank
from scaletrain.errors import UsageError
from scaletrain.config import ResolvedDSConfig, RunConfig
from scaletrain.data import TrainingData
from scaletrain.parts import DistInfo
from scaletrain.train.state import TrainState

log = logging.getLogger(__name__)


def reference_identity(cfg: RunConfig, *, precision: str, attn_implementation: str, block_size: int) -> dict:
    """What the saved log-probabilities depend on (JSON-serialisable): the reference's weights (its files, or the
    config and seed it is drawn from), the dtype, the attention backend, a 4-bit base, the adapter settings (the
    reference is the base with the adapter disabled), and how the pairs were cut. A file saved for another identity
    is never read: a changed setting computes them again."""
    args = cfg.preference
    source = args.ref_model_name_or_path or cfg.model.model_name_or_path
    if source:
        from scaletrain.model import base_identity

        model = base_identity(source)
    else:  # trained from scratch: the initial weights are the config's, drawn with the seed
        model = {"config": cfg.model.config_name, "seed": cfg.optim.seed}
    own_base = args.ref_model_name_or_path is None  # the run's own starting model (its quantization and adapter)
    peft = cfg.peft
    return {
        "model": model,
        "precision": precision,
        "attention": attn_implementation,
        "quantization": "4-bit nf4" if own_base and peft.load_in_4bit else None,
        "adapter": [peft.lora_r, peft.lora_alpha, peft.lora_target_modules] if own_base and peft.use_peft else None,
        "block_size": block_size,
        "truncation": cfg.data.truncation,
    }


def reference_file(store: Path, split: str, identity: dict) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(store) / "reference" / f"{split}-{key}.npy"


@dataclass(frozen=True)
class ReferencePass:
    """Where a reference pass's results live and how it runs."""

    store: Path  # the token store its files sit beside
    identity: dict  # what they depend on (reference_identity)
    micro_batch: int
    source: str | None = None  # who computes them, for the log (None: the starting model)


def attach_reference_logps(engine, *, sets: dict, ref: ReferencePass, dist: DistInfo, fresh: bool, only=None) -> None:
    """Give every PreferencePairs in `sets` ({split: pairs}) its reference log-probabilities: read back, or (a fresh
    run only) computed on `engine` now and saved by each node's local rank 0. `only`: the training pairs a dry run's
    one step reads, not saved. The ranks decide together whether to read: with node-local stores a node may miss a
    file, and a rank that read while the others computed (collectives) would leave them waiting."""
    micro_batch, identity = ref.micro_batch, ref.identity
    for split, pairs in sets.items():
        path = reference_file(ref.store, split, identity)
        values, problem = _read_saved(path, pairs.n_split_pairs, identity)
        everywhere = every_rank(values is not None)
        if only is not None and not everywhere:
            if split == "train":
                pairs.ref_logps = compute_reference_logps(
                    engine,
                    pairs=pairs,
                    micro_batch=micro_batch,
                    dp_rank=dist.coords.dp,
                    dp_world=dist.layout.dp,
                    only=only,
                )
                log.info("reference log-probs: the dry run's %d pairs computed (not saved)", len(only))
            continue
        if everywhere:
            log.info("reference log-probs (%s): read from %s", split, path)
        elif not fresh:
            where = problem or "missing on another node (each node reads its own store)"
            raise UsageError(
                f"{path}: the reference log-probabilities of this run's {split} pairs are {where}, and a resumed run "
                "cannot compute them (its model is no longer the starting model)",
                "restore the file from where the run first started, or start afresh (--resume_from_checkpoint none)",
            )
        else:
            values = compute_reference_logps(
                engine, pairs=pairs, micro_batch=micro_batch, dp_rank=dist.coords.dp, dp_world=dist.layout.dp
            )
            if dist.local_rank == 0:
                _save(path, values, identity)
            log.info(
                f"reference log-probs ({split}): {len(pairs)} pairs computed by {ref.source or 'the starting model'}, "
                f"saved to {path}"
            )
        pairs.ref_logps = values


def _read_saved(path: Path, n_pairs: int, identity: dict) -> tuple:
    """(the saved log-probs, None), or (None, why not): missing, or damaged (unreadable, another shape, or made for
    another reference than its record says). A damaged file is said once and never trusted: a fresh run computes it
    again."""
    if not path.exists():
        return None, "missing"
    try:
        values = np.load(path)
        recorded = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError) as err:
        problem = f"damaged ({type(err).__name__}: {err})"
    else:
        if values.shape != (n_pairs, 2):
            problem = f"damaged (log-probs of {values.shape[0]} pairs, the split has {n_pairs})"
        elif recorded != identity:
            problem = "damaged (its record names another reference)"
        else:
            return values, None
    log.warning("%s: %s; not used", path, problem)
    return None, problem


def compute_reference_logps(engine, *, pairs, micro_batch: int, dp_rank: int, dp_world: int, only=None) -> np.ndarray:
    """[pairs of the split, 2]: each kept pair's (chosen, rejected) summed completion log-probs under `engine` (of
    the pair indices `only`, where given; 0 for the others), in eval mode and without gradients. Every rank runs the
    same number of forwards (ZeRO-3 gathers are collectives)."""
    import deepspeed.comm as ds_comm
    import torch

    from scaletrain.train.preference import row_logps

    wanted = np.arange(len(pairs)) if only is None else np.asarray(only, dtype=np.int64)
    wanted = wanted[wanted != EMPTY_SLOT]
    per_rank = max(1, math.ceil(math.ceil(len(wanted) / dp_world) / micro_batch)) * micro_batch
    mine = np.full(per_rank, EMPTY_SLOT, dtype=np.int64)
    owned = wanted[dp_rank::dp_world]
    mine[: len(owned)] = owned
    values = torch.zeros(pairs.n_split_pairs, 2, dtype=torch.float64, device=engine.device)
    engine.eval()
    with torch.no_grad():
        for chunk in mine.reshape(-1, micro_batch):
            batch = pairs.batch(chunk)
            logps, _ = row_logps(engine, batch, engine.device)
            ids = batch["pair_ids"].to(engine.device)
            real = ids >= 0
            n = len(chunk)
            values[ids[real], 0] = logps[:n][real].double()
            values[ids[real], 1] = logps[n:][real].double()
    engine.train()
    ds_comm.all_reduce(values)  # each pair was computed by exactly one rank
    return values.cpu().numpy()


def _save(path: Path, values: np.ndarray, identity: dict) -> None:
    """Atomically: a file that exists is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, values)
    path.with_suffix(".json").write_text(json.dumps(identity, indent=2) + "\n")
    os.replace(tmp, path)


def prepare_reference(
    engine,
    *,
    cfg: RunConfig,
    ds: ResolvedDSConfig,
    dist: DistInfo,
    identity: dict | None,
    data: TrainingData,
    state: TrainState,
):
    """A preference run's reference, before the first step: its log-probs of the training pairs and of every
    validation set read back or computed now (--precompute_ref_log_probs), or, for a reference that runs at every
    step, its engine (returned; None where the reference is the LoRA base or the loss needs none). `identity`:
    reference_identity's, what the saved log-probs depend on (None where none are precomputed). A dry run computes
    its first global batch's pairs alone and saves nothing; the starting model computes them only on a fresh start
    (`state` at step 0)."""
    args = cfg.preference
    fresh = state.step == 0
    only = data.order.global_batch_indices(state.step + state.data_offset) if cfg.run.dry_run else None
    separate = reference_model_args(cfg) is not None
    if not args.needs_reference or not args.precompute_ref_log_probs:
        return build_reference_engine(cfg, ds.config, ds.zero_stage) if separate else None
    assert identity is not None, "precomputed reference log-probs need the reference's identity"
    store = data.stores[0]["path"]
    sets = {"train": data.blocks, **{split: b.sources()[0] for split, b in data.eval_sets.items()}}
    micro = max(ds.micro_batch, cfg.optim.per_device_eval_batch_size)
    missing = any_rank(any(not reference_file(store, split, identity).exists() for split in sets))
    reference = build_reference_engine(cfg, ds.config, ds.zero_stage) if separate and missing else None
    try:  # a separate reference can compute what a resumed run misses; the starting model only on a fresh start
        source = f"--ref_model_name_or_path {args.ref_model_name_or_path}" if reference is not None else None
        ref = ReferencePass(store, identity, micro, source)
        attach_reference_logps(reference or engine, sets=sets, ref=ref, dist=dist, fresh=fresh or separate, only=only)
    finally:
        if reference is not None:
            from scaletrain.engine import release_engine

            release_engine(reference)
    return None


def reference_model_args(cfg):
    """ModelArgs of a separate reference model (--ref_model_name_or_path, or the starting model where the reference
    runs live and is not the LoRA base), or None when the training engine is the reference. No memory features:
    it runs without gradients."""
    import dataclasses

    args = cfg.preference
    live = args.needs_reference and not args.precompute_ref_log_probs
    path = args.ref_model_name_or_path or (cfg.model.model_name_or_path if live and not cfg.peft.use_peft else None)
    if path is None:
        return None
    return dataclasses.replace(
        cfg.model,
        model_name_or_path=path,
        config_name=None,
        gradient_checkpointing=False,
        activation_offloading=False,
        tiled_mlp=False,
    )


def check_reference_model(cfg, model_config) -> None:
    """Pre-flight: a separate reference model must read the policy's tokens (the same vocabulary)."""
    args = reference_model_args(cfg)
    if args is None or not cfg.preference.ref_model_name_or_path:
        return
    from scaletrain.model import load_model_config

    try:
        ref_config = load_model_config(args)
    except UsageError as err:
        raise UsageError(err.message.replace("--model_name_or_path", "--ref_model_name_or_path"), err.hint) from None
    ours, theirs = (getattr(c.get_text_config(), "vocab_size", None) for c in (model_config, ref_config))
    if ours != theirs:
        raise UsageError(
            f"--ref_model_name_or_path {args.model_name_or_path}: a vocabulary of {theirs} tokens, the policy's has "
            f"{ours}",
            "give a reference with the policy's tokenizer (usually the SFT model the policy starts from)",
        )


def build_reference_engine(cfg, ds_config: dict, zero_stage: int):
    """The reference model as its own DeepSpeed engine without optimizer or gradients, as TRL prepares one: under
    ZeRO-3 sharded like the policy (built inside zero.Init), under ZeRO-1/2 whole on each rank (stage 0)."""
    import copy

    import deepspeed

    from scaletrain.model import build_model, load_model_config

    from transformers.integrations import deepspeed as hf_deepspeed

    args = reference_model_args(cfg)
    policy_config = hf_deepspeed._hf_deepspeed_config_weak_ref  # building the reference's replaces it
    config = copy.deepcopy(ds_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero_stage != 3:
        config["zero_optimization"] = {"stage": 0}
    model, keepalive = build_model(args, load_model_config(args), config)
    if policy_config is not None and policy_config() is not None:
        hf_deepspeed.set_hf_deepspeed_config(policy_config())
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    engine.scaletrain_keepalive = keepalive  # transformers holds the ZeRO-3 config weakly: keep it with the engine
    log.info("reference model: %s, its own engine (ZeRO stage %d, no optimizer)", args.model_name_or_path, zero_stage)
    return engine
