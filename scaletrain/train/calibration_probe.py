"""What --plan_calibration needs beside the steps' phases, measured after a run's last step, once everything of the
run is saved: the fixed cost of a micro-batch (step.micro_batch_fixed_seconds) and the fused attention's rate at the
run's shape, written to the run folder (observability.write_micro_batch_probe)."""

from __future__ import annotations

import logging
from pathlib import Path

from scaletrain.observability import attention_heads, measured_attention_tflops, write_micro_batch_probe
from scaletrain.parts import ParallelLayout
from scaletrain.train.step import PROBE_TOKENS, micro_batch_fixed_seconds

log = logging.getLogger(__name__)

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def probe_for_calibration(
    engine, *, model_config, precision: str, block_size: int, layout: ParallelLayout, output_dir: str, is_main: bool
) -> None:
    """Measure and record the probe on every rank (rank 0 writes it). `layout` names this rank's tensor split: each
    rank's attention runs its heads / TP heads."""
    import torch

    seconds = micro_batch_fixed_seconds(engine)
    heads, head_dim = attention_heads(model_config)
    dtype = getattr(torch, DTYPES[precision])
    micro_batch = engine.train_micro_batch_size_per_gpu()
    attention = None
    if heads and head_dim:  # a model that names its attention's shape
        heads //= layout.tp
        attention = measured_attention_tflops(
            engine.device, dtype=dtype, batch=micro_batch, heads=heads, seq_len=block_size, head_dim=head_dim
        )
        log.info(f"attention at {attention:.3g} TFLOP/s ({micro_batch} x {block_size} tokens, {heads} heads)")
    log.info("a micro-batch's fixed cost: %.3g ms (one %d-token sequence)", seconds * 1e3, PROBE_TOKENS)
    if is_main:
        write_micro_batch_probe(Path(output_dir), seconds, PROBE_TOKENS, attention)


def probe_applies(engine, *, layout: ParallelLayout, preference: bool) -> bool:
    """Not where a micro-batch takes another path (the pipeline's schedule, sequence-parallel shards, preference
    pairs) or where a new shape would recompile."""
    return not (layout.pp > 1 or layout.sp > 1 or preference or engine.is_compiled)
