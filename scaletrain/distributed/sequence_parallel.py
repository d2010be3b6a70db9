"""Sequence parallelism: DeepSpeed Ulysses (ALST) for Hugging Face models, fed by our own data path. Each rank of a
group reads the same micro-batches and keeps its 1/sp of each block, labels shifted over the whole block first so no
target is lost at a cut. With tensor parallelism the heads are split by TP first (AutoTP's column split of q, k, v),
then Ulysses exchanges each tensor rank's heads within its sequence group: the ranks that share its tensor coordinate
in one replica (ParallelLayout numbers tensor fastest, so a sequence group is every TP-th rank of a block of TP x SP).
We build that group and DeepSpeed's UlyssesSPAttentionHF over it with the heads a tensor rank holds;
register_with_transformers would build consecutive groups over the whole world with the model's head counts. No
`mpu` is passed on for the sequence groups: with DeepSpeed's, 0.19.8 sums ZeRO-1/2 gradients over the group but
averages ZeRO-3's and records SP as a tensor-parallel degree that ds_to_universal rejects; without it every ZeRO stage
averages over its data-parallel group (every rank, or with TP every rank of a tensor coordinate: data x sequence), so
the loss is scaled by that group's size / global targets (measured against one rank:
tests/distributed/test_sequence_parallel.py, test_composed_layouts.py). Ulysses drops the attention mask, so under
--attention_isolation each document attends alone through causal SDPA: memory linear in the block, no [T, T] mask.
Details: docs/parallelism.md#sequence-parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from scaletrain.data import IGNORE_INDEX
from scaletrain.parts import DistInfo

log = logging.getLogger(__name__)


def _isolating_sdpa(core):
    """SDPA that keeps packed documents apart when it gets the whole sequence without a mask (Ulysses' call):
    causal attention over each document on its own, so nothing of size [T, T] exists (a boolean mask would be
    16 GiB at 128K tokens, and with a mask SDPA leaves its memory-efficient kernels for one that keeps the scores)."""
    from transformers.masking_utils import find_packed_sequence_indices

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        positions = kwargs.get("position_ids")
        if attention_mask is None and positions is not None and positions.shape[-1] == query.shape[2] == key.shape[2]:
            documents = find_packed_sequence_indices(positions.expand(query.shape[0], -1))
            if documents is not None:
                return _per_document(core, documents, module, query, key, value, *args, **kwargs)
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def document_spans(documents) -> list:
    """[(start, end)] of each run of equal document indices in one row."""
    import torch

    cuts = (torch.nonzero(documents[1:] != documents[:-1]).flatten() + 1).tolist()
    return list(zip([0, *cuts], [*cuts, documents.shape[0]], strict=True))


def _per_document(core, documents, module, query, key, value, *args, **kwargs):
    """Causal attention of each document of each row alone; outputs [batch, T, heads, head_dim] as SDPA's."""
    import torch

    rows = []
    for row in range(query.shape[0]):
        pieces = [
            core(module, *(t[row : row + 1, :, lo:hi] for t in (query, key, value)), None, *args, **kwargs)[0]
            for lo, hi in document_spans(documents[row])
        ]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0), None


def _keeping_kv_groups(ulysses):
    """Ulysses, leaving each attention module's num_key_value_groups as it found it. Past the KV heads (the degree a
    multiple of them) DeepSpeed repeats the KV heads across the group and sets the module's groups to the local
    ratio for its own call, for good; an evaluation (whole blocks, Ulysses bypassed) would then repeat the KV heads
    too few times."""

    def attention(module, *args, **kwargs):
        groups = getattr(module, "num_key_value_groups", None)
        try:
            return ulysses(module, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups

    return attention


def sequence_group(layout, rank: int):
    """This rank's sequence-parallel process group; every group is created on every rank, in the same order, as
    torch.distributed requires."""
    import deepspeed.comm as ds_comm

    mine = None
    for ranks in layout.groups("sp"):
        group = ds_comm.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


def register_ulysses(
    model, *, dist: DistInfo, model_config, block_size: int, micro_batch: int, attention_isolation: bool
) -> Callable[[], None]:
    """Route the model's attention (SDPA or FlashAttention) through Ulysses over this rank's sequence group
    (process-wide: transformers' attention table), before the first forward. With tensor parallelism Ulysses sees
    the heads of one tensor rank. Evaluation bypasses it (disable_in_eval): every rank evaluates whole blocks.
    FlashAttention keeps packed documents apart by itself, from the gathered position ids. Returns the undo, which
    lets go of the sequence group before the process group's teardown (the attention table and DeepSpeed's
    all-to-all registry would hold it, and gloo's threads with it, until the interpreter exits).
    `attention_isolation`: packed documents are kept apart (SDPA: by our per-document attention)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from scaletrain.engine import release_sequence_group

    layout = dist.layout
    text_config = model_config.get_text_config()
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads

    backend = model.config._attn_implementation
    core = original = ALL_ATTENTION_FUNCTIONS[backend]
    if attention_isolation and backend == "sdpa":
        core = _isolating_sdpa(core)
    ulysses = UlyssesSPAttentionHF(
        attn=core,
        batch_size=micro_batch,
        attn_head_count=heads // layout.tp,  # AutoTP's split: this tensor rank's heads
        attn_head_size=head_dim,
        kv_head_count=kv_heads // layout.tp,
        num_hidden_layers=text_config.num_hidden_layers,
        process_group=sequence_group(layout, dist.rank),
        seq_length_is_variable=True,
        disable_in_eval=True,
    )
    ulysses.core_attn_implementation = backend

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        # The mask transformers built is the shard's; Ulysses attends causally over the gathered sequence instead.
        return ulysses(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[backend] = _keeping_kv_groups(attention)
    log.info(
        f"sequence parallelism: DeepSpeed Ulysses ({backend}) over {layout.sp} ranks, {block_size // layout.sp} tokens "
        f"of each {block_size}-token block per rank"
        f"{f', {heads // layout.tp} heads of each tensor rank exchanged' if layout.tp > 1 else ''}"
        f"{', documents isolated' if attention_isolation else ''}"
    )

    def unregister() -> None:
        ALL_ATTENTION_FUNCTIONS[backend] = original
        release_sequence_group(ulysses.process_group)
        ulysses.process_group = None

    return unregister


def sequence_shard(batch: dict, sp_rank: int, sp: int) -> dict:
    """This rank's tokens of a micro-batch: input ids, position ids and the pre-shifted labels ("shift_labels")."""
    import torch
    import torch.nn.functional as F

    input_ids = batch["input_ids"]
    length = input_ids.shape[1]
    lo, hi = sp_rank * length // sp, (sp_rank + 1) * length // sp
    positions = batch.get("position_ids")
    if positions is None:  # Ulysses needs the positions of the shard's tokens in the block
        positions = torch.arange(length).unsqueeze(0).expand_as(input_ids)
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    return {
        "input_ids": input_ids[:, lo:hi].contiguous(),
        "position_ids": positions[:, lo:hi].contiguous(),
        "shift_labels": shifted[:, lo:hi].contiguous(),
    }
