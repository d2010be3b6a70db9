"""--plan's report: the run's flags turned into the planned run, and the memory plan printed (the table of every ZeRO
option, the longest blocks, the recommendation, and the host memory of --async_save's snapshots)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pathlib import Path

from scaletrain.observability.long_context_plan import render_longest_blocks
from scaletrain.observability.memory_planner import (
    GIB,
    OPTIONS,
    MemoryFeatures,
    ModelShape,
    Option,
    PlannedRun,
    auto_loss_chunk,
    plan_memory,
    render_memory_plan,
    snapshot_bytes_per_rank,
)
from scaletrain.config import GPUS
from scaletrain.observability.calibration import calibrate, calibrated_gpu, describe_calibration
from scaletrain.observability.time_model import Cluster
from scaletrain.observability.time_plan import (
    Planner,
    flags_candidate,
    render_scaling,
    render_time_plan,
    scaling_rows,
    write_plan_json,
)
from scaletrain.parts import ParallelLayout

if TYPE_CHECKING:
    from scaletrain.config import ResolvedDSConfig, RunConfig


def planned_run(cfg: RunConfig, shape: ModelShape, block_size: int) -> PlannedRun:
    """The run --plan sizes: --num_gpus x --num_nodes, the run's batch, layout and memory features, and its training
    precision (--plan_precision where the DeepSpeed config leaves it open)."""
    planning, engine, parallel, model = cfg.planning, cfg.engine, cfg.parallel, cfg.model
    chunk, ranks = model.loss_chunk_size, planning.num_gpus * planning.num_nodes
    return PlannedRun(
        gpus_per_node=planning.num_gpus,
        nodes=planning.num_nodes,
        parallel=ParallelLayout.of_world(
            ranks, parallel.tensor_parallel_size, parallel.sequence_parallel_size, parallel.pipeline_parallel_size
        ),
        micro_batch=cfg.optim.per_device_train_batch_size,
        block_size=block_size,
        precision="bf16" if engine.bf16 else "fp16" if engine.fp16 else planning.plan_precision,
        loss_chunk=None if chunk == 0 else chunk or auto_loss_chunk(shape.vocab),
        grad_accum=cfg.optim.gradient_accumulation_steps,
        features=MemoryFeatures(model.tiled_mlp, model.activation_offloading),
    )


def print_memory_plan(
    cfg: RunConfig, shape: ModelShape, block_size: int, ds: ResolvedDSConfig, calibration: tuple | None = None
) -> None:
    """--plan: the memory table for each ZeRO stage and offload option, the longest blocks, then the time plan (every
    layout of the flags' global batch, predicted, the fastest that fits recommended) and --plan_scaling's table."""
    planning = cfg.planning
    run = planned_run(cfg, shape, block_size)
    longest_blocks = None
    if run.parallel.tp == 1 and run.parallel.pp == 1 and shape.heads:  # the longest block per long-context feature
        host = planning.host_memory_gb and planning.host_memory_gb * GIB
        longest_blocks = render_longest_blocks(shape, run, planning.memory_gb * GIB, host)
    estimates = plan_memory(shape, run)
    print(
        render_memory_plan(
            estimates, shape, run, planning.memory_gb, planning.host_memory_gb, longest_blocks=longest_blocks
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
    print()
    print("\n".join(time_plan_lines(cfg, shape, run, ds, calibration)))


def planned_cluster(cfg: RunConfig, nodes: int | None = None, calibration: tuple | None = None) -> Cluster:
    """The cluster --plan plans for: --num_nodes x --num_gpus of --gpu; with --plan_calibration the measured run's
    rates, and without an explicit --gpu its device (and, without --num_gpus/--num_nodes, its world on one node)."""
    planning, explicit = cfg.planning, cfg.explicit_flags
    gpus_per_node, nodes = planning.num_gpus, nodes or planning.num_nodes
    gpu = GPUS[planning.gpu]
    if calibration is not None:
        measured, _ = calibration
        if "gpu" not in explicit:
            gpu = calibrated_gpu(measured, planning.memory_gb)
        if not {"num_gpus", "num_nodes"} & explicit:
            gpus_per_node = measured.world
    cluster = Cluster(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        inter_node_gbps=planning.inter_node_gbps,
        peak_tflops=planning.gpu_peak_tflops,
        intra_node_gbs=planning.intra_node_gbps,
    )
    return cluster if calibration is None else calibrate(cluster, *calibration)


def flags_option(cfg: RunConfig, ds: ResolvedDSConfig) -> Option:
    """The ZeRO option the flags' --config names (its stage and offload devices)."""
    optimizer, params = ds.offload_devices
    for option in OPTIONS:
        if (option.stage, option.offload_optimizer, option.offload_params) == (ds.zero_stage, optimizer, params):
            return option
    return Option(f"ZeRO-{ds.zero_stage}", Path(cfg.engine.config).name, ds.zero_stage, optimizer, params)


def time_plan_lines(
    cfg: RunConfig, shape: ModelShape, run: PlannedRun, ds: ResolvedDSConfig, calibration: tuple | None
) -> list[str]:
    """The time table for the flags' global batch, the scaling table, and --plan_json written."""
    planning, optim = cfg.planning, cfg.optim
    gpu_bytes = planning.memory_gb * GIB
    host_bytes = planning.host_memory_gb and planning.host_memory_gb * GIB

    def planner_for(nodes: int) -> Planner:
        return Planner(shape, run, planned_cluster(cfg, nodes, calibration), gpu_bytes, host_bytes)

    planner = planner_for(planning.num_nodes)
    option = flags_option(cfg, ds)
    accum = optim.gradient_accumulation_steps
    flags = flags_candidate(planner, option, run, accum, cfg.model.gradient_checkpointing)
    global_sequences = run.micro_batch * accum * flags.layout.parallel.dp
    candidates = planner.candidates(global_sequences, cfg.parallel.allow_cross_node_tensor_parallel)
    lines = [] if calibration is None else [describe_calibration(calibration[0], planner.cluster)]
    lines += render_time_plan(
        planner.cluster, flags, candidates, run.block_size, global_sequences, planning.plan_tokens
    )
    scaling, node_counts = None, planning.scaling_nodes()
    if node_counts:
        scaling = scaling_rows(planner_for, node_counts, flags.layout, option)
        lines += ["", *render_scaling(scaling, global_sequences)]
    if planning.plan_json:
        write_plan_json(Path(planning.plan_json), flags, candidates, scaling)
        lines.append(f"plan written to {planning.plan_json}")
    return lines
