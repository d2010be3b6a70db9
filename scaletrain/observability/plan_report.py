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
    HEADROOM,
    Estimate,
    layout_flags,
    plan_memory,
    recommend,
    recommend_layout,
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
    cfg: RunConfig, *, shape: ModelShape, block_size: int, ds: ResolvedDSConfig, calibration: tuple | None = None
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
            estimates,
            shape=shape,
            run=run,
            gpu_memory_gb=planning.memory_gb,
            host_memory_gb=planning.host_memory_gb,
            longest_blocks=longest_blocks,
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
    print("\n".join(time_plan_lines(cfg, shape=shape, run=run, ds=ds, calibration=calibration)))


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
    return Option(
        f"ZeRO-{ds.zero_stage}",
        ds_config=Path(cfg.engine.config).name,
        stage=ds.zero_stage,
        offload_optimizer=optimizer,
        offload_params=params,
    )


def time_plan_lines(
    cfg: RunConfig, *, shape: ModelShape, run: PlannedRun, ds: ResolvedDSConfig, calibration: tuple | None
) -> list[str]:
    """The time table for the flags' global batch, the scaling table, and --plan_json written."""
    planning, optim = cfg.planning, cfg.optim
    gpu_bytes = planning.memory_gb * GIB
    host_bytes = planning.host_memory_gb and planning.host_memory_gb * GIB

    def planner_for(nodes: int) -> Planner:
        return Planner(
            shape, run=run, cluster=planned_cluster(cfg, nodes, calibration), gpu_bytes=gpu_bytes, host_bytes=host_bytes
        )

    planner = planner_for(planning.num_nodes)
    option = flags_option(cfg, ds)
    accum = optim.gradient_accumulation_steps
    flags = flags_candidate(
        planner, option=option, run=run, accum=accum, checkpointing=cfg.model.gradient_checkpointing
    )
    global_sequences = run.micro_batch * accum * flags.layout.parallel.dp
    candidates = planner.candidates(global_sequences, cfg.parallel.allow_cross_node_tensor_parallel)
    lines = [] if calibration is None else [describe_calibration(calibration[0], planner.cluster)]
    lines += render_time_plan(
        planner.cluster,
        flags=flags,
        candidates=candidates,
        block_size=run.block_size,
        global_sequences=global_sequences,
        tokens=planning.plan_tokens,
    )
    if not cfg.parallel.allow_cross_node_tensor_parallel:
        beyond = sorted(set(planner.tensor_sizes(cross_node=True)) - set(planner.tensor_sizes()))
        if beyond:
            lines.append(
                f"not planned: tensor parallel {', '.join(map(str, beyond))} across nodes (each layer's all-reduces "
                "would cross the network); --allow_cross_node_tensor_parallel plans them"
            )
    scaling, node_counts = None, planning.scaling_nodes()
    if node_counts:
        scaling = scaling_rows(planner_for, node_counts, flags.layout, option)
        lines += ["", *render_scaling(scaling, global_sequences)]
    if planning.plan_json:
        write_plan_json(Path(planning.plan_json), flags, candidates, scaling)
        lines.append(f"plan written to {planning.plan_json}")
    return lines


def _describe(parallel: ParallelLayout) -> str:
    """ "8 ranks: tensor parallel 2 x 4 data-parallel" (the memory plan's header; ParallelLayout.describe's words
    with the rank count)."""
    kinds = (("tensor", parallel.tp), ("sequence", parallel.sp), ("pipeline", parallel.pp))
    sizes = [(kind, size) for kind, size in kinds if size > 1]
    if not sizes:
        return f"{parallel.world_size} data-parallel ranks"
    return (
        f"{parallel.world_size} ranks: "
        + " x ".join(f"{kind} parallel {size}" for kind, size in sizes)
        + f" x {parallel.dp} data-parallel"
    )


def render_memory_plan(
    estimates: list[Estimate],
    *,
    shape: ModelShape,
    run: PlannedRun,
    gpu_memory_gb: float,
    host_memory_gb: float | None,
    longest_blocks: list | None = None,
) -> str:
    """--plan's table of `estimates` for `run`, the `longest_blocks` lines (long_context_plan.py) and the
    recommendation: for an open layout the fastest one that fits, otherwise the fastest option of the one given."""
    gb = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    gpu_bytes, host_bytes = gpu_memory_gb * GIB, None if host_memory_gb is None else host_memory_gb * GIB
    tp, sp, pp = run.parallel.tp, run.parallel.sp, run.parallel.pp
    lines = [
        f"memory plan: {shape.n_params / 1e6:.1f}M parameters, {run.nodes} node(s) x {run.gpus_per_node} GPU(s) = "
        f"{_describe(run.parallel)}, {run.precision}, micro-batch {run.micro_batch} x {run.block_size} "
        f"tokens{run.features.describe()}, {gpu_memory_gb:g} GB per GPU"
        + ("" if host_memory_gb is None else f", {host_memory_gb:g} GB host per node"),
        "GB per GPU unless marked; working: what a step holds beyond the model states at its peak (0 where the "
        "update's gradients are the peak); 'fits' leaves 10% of the GPU free (fragmentation, communication buffers)",
        "",
        "| option | params | grads | optimizer | model states | working (no ckpt / ckpt) | total (no ckpt / "
        "ckpt) | host per node | NVMe per node | fits (no ckpt / ckpt) | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for est in estimates:
        fits = []
        for ckpt in (False, True):
            ok = est.total(ckpt) <= HEADROOM * gpu_bytes and (
                host_bytes is None or est.host_per_node <= HEADROOM * host_bytes
            )
            fits.append("yes" if ok else "no")
        lines.append(
            f"| {est.option.name} | {gb(est.params)} | {gb(est.grads)} | {gb(est.optimizer)} | {gb(est.model_states)} "
            f"| {gb(est.activations)} / {gb(est.activations_checkpointed)} | {gb(est.total(False))} / "
            f"{gb(est.total(True))} | {gb(est.host_per_node)} | {gb(est.nvme_per_node)} | {' / '.join(fits)} | "
            f"ds_configs/{est.option.ds_config} |"
        )
    if longest_blocks:
        lines += ["", *longest_blocks]
    if tp == 1 and sp == 1 and pp == 1:  # the layout is open: data parallelism, then TP, then PP, then offload
        choice = recommend_layout(shape, run, gpu_bytes, host_bytes)
    else:  # the layout was given
        choice = recommend(estimates, gpu_bytes, host_bytes)
        choice = choice and (tp, pp, *choice)
    lines.append("")
    if sp > 1 and pp > 1:
        lines.append("planning only: train.py does not run sequence parallelism with pipeline parallelism")
    if choice is None:
        lines.append(
            "memory plan's choice: nothing fits; lower --per_device_train_batch_size or --block_size, add GPUs or "
            "nodes (ZeRO-3 divides the model states by the rank count), or use GPUs with more memory"
        )
    else:
        chosen_tp, chosen_pp, est, ckpt = choice
        lines.append(
            f"memory plan's choice: --config ds_configs/{est.option.ds_config}"
            + layout_flags(chosen_tp, sp, chosen_pp)
            + (" --gradient_checkpointing" if ckpt else "")
            + f" ({est.option.name}{', activation checkpointing' if ckpt else ''}: "
            f"{gb(est.total(ckpt))} of {gpu_memory_gb:g} GB per GPU)"
        )
    return "\n".join(lines)
