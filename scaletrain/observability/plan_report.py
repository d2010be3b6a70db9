"""--plan's report: the run's flags turned into the planned run, and the memory plan printed (the table of every ZeRO
option, the longest blocks, the recommendation, and the host memory of --async_save's snapshots)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain.observability.long_context_plan import render_longest_blocks
from scaletrain.observability.memory_planner import (
    GIB,
    MemoryFeatures,
    ModelShape,
    PlannedRun,
    auto_loss_chunk,
    plan_memory,
    render_memory_plan,
    snapshot_bytes_per_rank,
)

if TYPE_CHECKING:
    from scaletrain.config import RunConfig


def planned_run(cfg: RunConfig, shape: ModelShape, block_size: int) -> PlannedRun:
    """The run --plan sizes: --num_gpus x --num_nodes, the run's batch, layout and memory features, and its training
    precision (--plan_precision where the DeepSpeed config leaves it open)."""
    planning, engine, parallel, model = cfg.planning, cfg.engine, cfg.parallel, cfg.model
    chunk = model.loss_chunk_size
    return PlannedRun(
        gpus_per_node=planning.num_gpus,
        nodes=planning.num_nodes,
        micro_batch=cfg.optim.per_device_train_batch_size,
        block_size=block_size,
        precision="bf16" if engine.bf16 else "fp16" if engine.fp16 else planning.plan_precision,
        tp=parallel.tensor_parallel_size,
        sp=parallel.sequence_parallel_size,
        pp=parallel.pipeline_parallel_size,
        loss_chunk=None if chunk == 0 else chunk or auto_loss_chunk(shape.vocab),
        features=MemoryFeatures(model.tiled_mlp, model.activation_offloading),
    )


def print_memory_plan(cfg: RunConfig, shape: ModelShape, block_size: int) -> None:
    """--plan: the memory table for each ZeRO stage and offload option, and the recommended config."""
    planning = cfg.planning
    run = planned_run(cfg, shape, block_size)
    longest_blocks = None
    if run.tp == 1 and run.pp == 1 and shape.heads:  # the longest block with each long-context feature
        host = planning.host_memory_gb and planning.host_memory_gb * GIB
        longest_blocks = render_longest_blocks(shape, run, planning.gpu_memory_gb * GIB, host)
    estimates = plan_memory(shape, run)
    print(
        render_memory_plan(
            estimates, shape, run, planning.gpu_memory_gb, planning.host_memory_gb, longest_blocks=longest_blocks
        )
    )
    if cfg.checkpoint.async_save:  # the host memory asynchronous saves take beside the plan above
        per_rank = {
            zero: snapshot_bytes_per_rank(shape.n_params, run.precision, zero, run.ranks) / GIB for zero in (1, 3)
        }
        print(
            f"--async_save: snapshot buffers in host memory (/dev/shm), per rank: up to {per_rank[1]:.2f} GiB under "
            f"ZeRO-0/1/2 (rank 0 also copies the module's weights), {per_rank[3]:.2f} GiB under ZeRO-3; x "
            f"{planning.num_gpus} ranks per node (--no-async_save needs none)"
        )
