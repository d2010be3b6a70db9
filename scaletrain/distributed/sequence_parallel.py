"""Sequence parallelism: DeepSpeed Ulysses (ALST) for Hugging Face models, fed by our own data path.

Every rank of a sequence-parallel group reads the same micro-batches (scaletrain.data.sampling) and keeps tokens
[r T/sp, (r+1) T/sp) of each block: input ids, position ids, and the labels shifted over the whole block first, so
that a shard's last token is trained on the next shard's first. Ulysses' attention all-to-alls gather the sequence
and split the heads, so each rank attends over the whole block for its heads. Each rank's loss is the sum over its
shard's targets; the summed losses of all ranks are the block's.

Measured against one rank on DeepSpeed 0.19.8 (tests/test_sequence_parallel.py): without the `mpu`
register_with_transformers returns, DeepSpeed averages gradients over every rank of the world for ZeRO-1, 2 and 3
alike, so the loss is scaled by the world size over the global target count. (With the mpu, ZeRO-1/2 sum over the
sequence-parallel group while ZeRO-3 averages, its checkpoints record the SP size as a tensor-parallel degree that
ds_to_universal then rejects, and the engine's data-parallel size is None.)

Ulysses drops the attention mask (it relies on causal SDPA), so documents packed in a block would attend to each
other: under --attention_isolation the core SDPA is wrapped to build the per-document causal mask from the gathered
position ids, as transformers does for one rank.
"""

from __future__ import annotations

import logging

from scaletrain.data import IGNORE_INDEX

log = logging.getLogger(__name__)


def _isolating_sdpa(core):
    """SDPA that masks attention per document when it gets the whole sequence without a mask (Ulysses' call)."""
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        positions = kwargs.get("position_ids")
        if attention_mask is None and positions is not None and positions.shape[-1] == query.shape[2] == key.shape[2]:
            documents = find_packed_sequence_indices(positions.expand(query.shape[0], -1))
            if documents is not None:
                n = query.shape[2]
                causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
                attention_mask = (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def register_ulysses(
    model, sequence_parallel_size: int, micro_batch: int, block_size: int, attention_isolation: bool
) -> None:
    """Route the model's SDPA attention through Ulysses (process-wide: transformers' attention table), before the
    first forward. Evaluation bypasses it (disable_in_eval): every rank evaluates whole blocks."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if attention_isolation:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _isolating_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
    # The returned mpu is not passed to deepspeed.initialize: see the module docstring.
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch,
        seq_length=block_size,
        seq_length_is_variable=True,
        disable_in_eval=True,
    )
    log.info(
        "sequence parallelism: DeepSpeed Ulysses over %d ranks, %d tokens of each %d-token block per rank%s",
        sequence_parallel_size,
        block_size // sequence_parallel_size,
        block_size,
        ", documents isolated" if attention_isolation else "",
    )


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
