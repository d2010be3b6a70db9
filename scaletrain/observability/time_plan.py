"""--plan's time half: every layout that runs the flags' global batch on the planned cluster (tensor, pipeline and
sequence sizes, ZeRO option, micro-batch and accumulation, activation checkpointing), each with its memory
(memory_planner) and predicted step time (time_model), the fastest that fits recommended, the scaling table of
--plan_scaling, and the machine-readable plan of --plan_json."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from scaletrain.observability.long_context_plan import ulysses_degrees
from scaletrain.observability.memory_planner import (
    GIB,
    HEADROOM,
    Estimate,
    ModelShape,
    Option,
    PlannedRun,
    layout_flags,
    options_for,
    plan_memory,
)
from scaletrain.observability.time_model import Cluster, Layout, StepPrediction, predict_step
from scaletrain.parts import ParallelLayout

TERM_NAMES = {
    "compute": "compute",
    "tensor_parallel": "TP comm",
    "sequence_parallel": "SP all-to-all",
    "pipeline_bubble": "PP bubble",
    "pipeline_p2p": "PP p2p",
    "data_parallel": "DP/ZeRO comm",
    "optimizer": "optimizer",
    "offload": "offload",
    "overhead": "other",
}
# The likely fix when a term's share grows (scaling tables and scripts/scaling_report.py name it).
FIXES = {
    "compute": "none needed: compute-bound",
    "tensor_parallel": "keep tensor parallelism inside a node, or a smaller --tensor_parallel_size",
    "sequence_parallel": "a smaller --sequence_parallel_size, or keep its group inside a node",
    "pipeline_bubble": "more micro-batches per step (--gradient_accumulation_steps) or fewer pipeline stages",
    "pipeline_p2p": "fewer pipeline stages, or a faster network between nodes",
    "data_parallel": "a larger micro-batch or accumulation (fewer reductions per token), ZeRO-1/2 instead of ZeRO-3, "
    "or hierarchical/quantized ZeRO-3 communication (zero_hpz_partition_size, zero_quantized_weights)",
    "optimizer": "more data-parallel ranks to partition the optimizer (ZeRO-1+)",
    "offload": "less offload (offload only what does not fit), or faster host links",
    "overhead": "data workers (--dataloader_num_workers) and fewer host synchronisations (--logging_steps)",
}


@dataclass(frozen=True)
class Candidate:
    """One layout with its option, memory and predicted step."""

    layout: Layout
    option: Option
    fits: bool
    peak_bytes: float
    prediction: StepPrediction

    def key(self) -> tuple:
        par = self.layout.parallel
        return (par.tp, par.pp, par.sp, self.option.name)

    def describe(self) -> str:
        par = self.layout.parallel
        sizes = [f"{kind} {size}" for kind, size in (("TP", par.tp), ("PP", par.pp), ("SP", par.sp)) if size > 1]
        return " x ".join([*sizes, f"DP {par.dp}"])

    def flags(self) -> str:
        lay, par = self.layout, self.layout.parallel
        return (
            f"--config ds_configs/{self.option.ds_config}"
            + layout_flags(par.tp, par.sp, par.pp)
            + f" --per_device_train_batch_size {lay.micro_batch} --gradient_accumulation_steps {lay.grad_accum}"
            + (" --gradient_checkpointing" if lay.checkpointing else "")
        )

    def as_dict(self) -> dict:
        lay, par = self.layout, self.layout.parallel
        return {
            "tensor_parallel_size": par.tp,
            "pipeline_parallel_size": par.pp,
            "sequence_parallel_size": par.sp,
            "data_parallel_size": par.dp,
            "zero_stage": lay.zero_stage,
            "offload": {"optimizer": lay.offload_optimizer, "param": lay.offload_params},
            "ds_config": f"ds_configs/{self.option.ds_config}",
            "micro_batch_size": lay.micro_batch,
            "gradient_accumulation_steps": lay.grad_accum,
            "gradient_checkpointing": lay.checkpointing,
            "fits": self.fits,
            "peak_memory_gb": self.peak_bytes / 1e9,
            **self.prediction.as_dict(),
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_upto(n: int) -> list[int]:
    sizes, size = [], 1
    while size <= n:
        sizes.append(size)
        size *= 2
    return sizes


class Planner:
    """Scores layouts of one model on one cluster: memory from the memory planner (cached per layout and micro-batch),
    time from the time model."""

    def __init__(self, shape: ModelShape, *, run: PlannedRun, cluster: Cluster, gpu_bytes: float, host_bytes):
        self.shape, self.run, self.cluster = shape, run, cluster
        self.gpu_bytes, self.host_bytes = gpu_bytes, host_bytes
        self._memory: dict = {}

    def _estimates(self, layout: Layout) -> dict:
        key = (layout.parallel, layout.micro_batch, layout.grad_accum)
        if key not in self._memory:
            run = planned_on(self.run, self.cluster, layout)
            self._memory[key] = {e.option.name: e for e in plan_memory(self.shape, run)}
        return self._memory[key]

    def score(self, layout: Layout, option: Option) -> Candidate:
        estimate: Estimate | None = self._estimates(layout).get(option.name)
        if estimate is None:  # an option the layout does not train with (the flags' own ZeRO-0, say): its states
            estimate = _estimate_for(option, shape=self.shape, run=self.run, layout=layout, cluster=self.cluster)
        peak = estimate.total(layout.checkpointing)
        fits = peak <= HEADROOM * self.gpu_bytes and (
            self.host_bytes is None or estimate.host_per_node <= HEADROOM * self.host_bytes
        )
        prediction = predict_step(
            self.shape, seq_len=self.run.block_size, layout=layout, cluster=self.cluster, precision=self.run.precision
        )
        return Candidate(layout, option=option, fits=fits, peak_bytes=peak, prediction=prediction)

    def tensor_sizes(self, cross_node: bool = False) -> list[int]:
        """The tensor-parallel sizes the model splits into on the cluster: inside a node, or (`cross_node`) up to
        the whole cluster."""
        shape, world, per_node = self.shape, self.cluster.world, self.cluster.gpus_per_node
        heads = shape.heads or 1
        return [
            t
            for t in _powers_of_two_upto(world if cross_node else per_node)
            if world % t == 0 and shape.splits_into(t) and heads % t == 0
        ]

    def candidates(self, global_sequences: int, cross_node_tensor: bool = False) -> list[Candidate]:
        """Every layout the pipeline runs for `global_sequences` sequences a step on the cluster, fastest first."""
        shape, world = self.shape, self.cluster.world
        scored = []
        for tp in self.tensor_sizes(cross_node_tensor):
            for pp in [p for p in _divisors(shape.layers) if world % (tp * p) == 0]:
                for sp in _sequence_degrees(shape, tp, world) if pp == 1 else [1]:  # SP does not compose with PP
                    parallel = ParallelLayout.of_world(world, tp, sp, pp)
                    if global_sequences % parallel.dp:
                        continue
                    per_rank = global_sequences // parallel.dp
                    for micro_batch in _divisors(per_rank):
                        accum = per_rank // micro_batch
                        if pp > 1 and accum < pp:  # left out: a stage idles all the time (train.py warns)
                            continue
                        for option in options_for(tp, sp, pp):
                            for checkpointing in (False, True):
                                layout = _layout(
                                    option,
                                    parallel=parallel,
                                    micro_batch=micro_batch,
                                    accum=accum,
                                    checkpointing=checkpointing,
                                )
                                scored.append(self.score(layout, option))
        return sorted(scored, key=lambda c: c.prediction.step_time)


def _sequence_degrees(shape: ModelShape, tp: int, world: int) -> list:
    """The Ulysses degrees for each tensor rank's heads (TP splits them first) over the ranks left to it."""
    if tp == 1:
        return ulysses_degrees(shape, world)
    local = replace(shape, heads=(shape.heads or 0) // tp, kv_heads=(shape.kv_heads or 0) // tp)  # 0: unknown
    return ulysses_degrees(local, world // tp)


def _layout(option: Option, *, parallel: ParallelLayout, micro_batch: int, accum: int, checkpointing: bool) -> Layout:
    return Layout(
        parallel,
        zero_stage=option.stage,
        offload_optimizer=option.offload_optimizer,
        offload_params=option.offload_params,
        micro_batch=micro_batch,
        grad_accum=accum,
        checkpointing=checkpointing,
    )


def planned_on(run: PlannedRun, cluster: Cluster, layout: Layout) -> PlannedRun:
    """`run` as the memory planner sizes `layout` on `cluster`: its GPUs, parallel layout, micro-batch and
    accumulation."""
    return replace(
        run, gpus_per_node=cluster.gpus_per_node, nodes=cluster.nodes, parallel=layout.parallel,
        micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
    )  # fmt: skip


def _estimate_for(option: Option, *, shape: ModelShape, run: PlannedRun, layout: Layout, cluster: Cluster) -> Estimate:
    """The memory of an option outside the layout's list (a ZeRO-0 pipeline): ZeRO-1's working memory, and whole
    optimizer states on every rank for ZeRO-0."""
    from scaletrain.observability.memory_planner import activation_bytes, model_state_bytes

    planned, parallel = planned_on(run, cluster, layout), layout.parallel
    act, act_ckpt = activation_bytes(shape, planned, max(option.stage, 1))
    dp = 1 if option.stage == 0 else planned.zero_ranks
    params, grads, optimizer, host, nvme = model_state_bytes(
        replace(option, stage=max(option.stage, 1)),
        shape=shape,
        dp=dp,
        precision=run.precision,
        tp=parallel.tp,
        pp=parallel.pp,
    )
    return Estimate(
        option,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=act,
        activations_checkpointed=act_ckpt,
        host_per_node=host * cluster.gpus_per_node,
        nvme_per_node=0.0,
    )


def flags_candidate(planner: Planner, *, option: Option, run: PlannedRun, accum: int, checkpointing: bool) -> Candidate:
    """The layout the flags name (`run`'s model-parallel sizes on the planner's cluster, its micro-batch), scored
    whether or not it fits."""
    sizes = run.parallel
    parallel = ParallelLayout.of_world(planner.cluster.world, sizes.tp, sizes.sp, sizes.pp)
    layout = _layout(option, parallel=parallel, micro_batch=run.micro_batch, accum=accum, checkpointing=checkpointing)
    return planner.score(layout, option)


def runner_up(candidates: list[Candidate], best: Candidate) -> Candidate | None:
    """The fastest fitting candidate of another layout (sizes or ZeRO option) than the best's."""
    return next((c for c in candidates if c.fits and c.key() != best.key()), None)


def separating_term(best: Candidate, other: Candidate) -> tuple:
    """(term, seconds) where `other` loses most against `best`."""
    gaps = {t: other.prediction.terms[t] - best.prediction.terms[t] for t in best.prediction.terms}
    term = max(gaps, key=lambda t: gaps[t])
    return term, gaps[term]


def _row(candidate: Candidate, label: str, tokens: float | None) -> str:
    p, lay = candidate.prediction, candidate.layout
    terms = " | ".join(f"{p.terms[t]:.3g}" for t in TERM_NAMES)
    days = f" | {p.days_for(tokens):.3g}" if tokens else ""
    fits = f"{'yes' if candidate.fits else 'no'} ({candidate.peak_bytes / GIB:.1f})"
    return (
        f"| {label}{candidate.describe()} | {candidate.option.name} | {lay.micro_batch} x {lay.grad_accum} | "
        f"{'yes' if lay.checkpointing else 'no'} | {fits} | {p.step_time:.3g} | {p.tokens_per_s:.4g} | "
        f"{p.model_flops_per_gpu / 1e12:.3g} | {p.mfu:.1%} | {terms}{days} |"
    )


def render_time_plan(
    cluster: Cluster,
    *,
    flags: Candidate,
    candidates: list[Candidate],
    block_size: int,
    global_sequences: int,
    tokens: float | None,
    top: int = 8,
) -> list[str]:
    """The time table: the flags' layout first, then the fastest `top` that fit, and the recommendation."""
    gpu = cluster.gpu
    lines = [
        f"time plan: {cluster.nodes} node(s) x {cluster.gpus_per_node} {gpu.name} (peak "
        f"{cluster.peak_flops / 1e12:g} TFLOP/s, matrix products at "
        f"{cluster.matmul_flops / cluster.peak_flops:.0%}; NVLink {cluster.intra_node_gbs or gpu.nvlink_gbs:g} GB/s a "
        f"GPU each way; network {cluster.inter_node_gbps:g} Gbit/s a node), global batch {global_sequences} x "
        f"{block_size} tokens",
        "seconds per step; each term is the time it adds to the step (overlapped communication excluded); "
        "formulas: docs/parallelism.md#time-model",
        "",
        "| layout | ZeRO | micro x accum | ckpt | fits (GiB) | step s | tokens/s | TFLOP/s/GPU | MFU | "
        + " | ".join(TERM_NAMES.values())
        + (" | days" if tokens else "")
        + " |",
        "|---" * (9 + len(TERM_NAMES) + (1 if tokens else 0)) + "|",
        _row(flags, "flags: ", tokens),
    ]
    fitting = [c for c in candidates if c.fits]
    lines += [_row(c, "", tokens) for c in fitting[:top]]
    lines.append("")
    if tokens:
        lines.append(f"days: to train {tokens:.3g} tokens (--plan_tokens) at the predicted tokens/s")
    if not fitting:
        lines.append("fastest that fits: nothing fits; add GPUs, lower the batch, or use GPUs with more memory")
        return lines
    best = fitting[0]
    second = runner_up(candidates, best)
    verdict = (
        f"recommended (fastest predicted that fits): {best.flags()} ({best.describe()}, {best.option.name}: "
        f"{best.prediction.step_time:.3g} s a step, {best.prediction.mfu:.0%} MFU)"
    )
    if second:
        term, gap = separating_term(best, second)
        verdict += (
            f"; runner-up {second.describe()}, {second.option.name}, micro-batch {second.layout.micro_batch}: "
            f"{second.prediction.step_time / best.prediction.step_time - 1:.0%} slower, mostly {TERM_NAMES[term]} "
            f"(+{gap:.3g} s)"
        )
    lines.append(verdict)
    return lines


def scaling_rows(planner_for, node_counts: list[int], layout: Layout, option: Option) -> list[dict]:
    """Predicted steps at each node count for `layout`'s model-parallel sizes, ZeRO option and checkpointing: at its
    fixed global batch (the accumulation shrinks first, then the micro-batch; None where the batch does not split
    over the data-parallel ranks) and at its fixed per-GPU batch (micro-batch and accumulation kept); a node count
    whose GPUs the layout's model-parallel groups do not tile is left out. `planner_for(nodes)` gives the Planner of
    that cluster."""
    rows, sizes = [], layout.parallel
    global_sequences = layout.micro_batch * layout.grad_accum * sizes.dp
    for nodes in node_counts:
        planner = planner_for(nodes)
        if planner.cluster.world % sizes.model_parallel:
            continue
        parallel = ParallelLayout.of_world(planner.cluster.world, sizes.tp, sizes.sp, sizes.pp)
        dp, fixed_global = parallel.dp, None
        if global_sequences % dp == 0:
            per_rank = global_sequences // dp
            accum = max(1, min(layout.grad_accum, per_rank))
            while per_rank % accum:
                accum -= 1
            shrunk = replace(layout, parallel=parallel, micro_batch=per_rank // accum, grad_accum=accum)
            fixed_global = planner.score(shrunk, option)
        fixed_per_gpu = planner.score(replace(layout, parallel=parallel), option)
        rows.append({"nodes": nodes, "gpus": planner.cluster.world, "fixed_global": fixed_global,
                     "fixed_per_gpu": fixed_per_gpu})  # fmt: skip
    return rows


def render_scaling(rows: list[dict], global_sequences: int) -> list[str]:
    """The --plan_scaling table and, for each regime, the term whose share of the step grew most."""
    lines = [
        "scaling (--plan_scaling): predicted tokens/s, speed-up and efficiency against the first size "
        f"(fixed global batch: {global_sequences} sequences a step)",
        "| nodes | GPUs | fixed global batch: micro x accum | tokens/s | speed-up | efficiency | fixed per-GPU batch: "
        "tokens/s | speed-up | efficiency |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if not rows:
        return [lines[0], "none of the node counts' GPUs split into the layout's model-parallel groups"]
    first = rows[0]
    for row in rows:
        scale = row["gpus"] / first["gpus"]
        cells = []
        for regime in ("fixed_global", "fixed_per_gpu"):
            this, base = row[regime], first[regime]
            if this is None or base is None:
                cells.append("n/a (the batch does not split over the data-parallel ranks) | | |")
                continue
            speed_up = this.prediction.tokens_per_s / base.prediction.tokens_per_s
            shape = f"{this.layout.micro_batch} x {this.layout.grad_accum} | " if regime == "fixed_global" else ""
            cells.append(f"{shape}{this.prediction.tokens_per_s:.4g} | {speed_up:.2f}x | {speed_up / scale:.0%} |")
        lines.append(f"| {row['nodes']} | {row['gpus']} | " + " ".join(cells))
    for regime, name in (("fixed_global", "fixed global batch"), ("fixed_per_gpu", "fixed per-GPU batch")):
        ends = [row[regime] for row in rows if row[regime] is not None]
        if len(ends) < 2:
            continue
        term, before, after = growing_term(ends[0].prediction, ends[-1].prediction)
        lines.append(
            f"{name}: {TERM_NAMES[term]} grows from {before:.0%} to {after:.0%} of the step; fix: {FIXES[term]}"
        )
    return lines


def growing_term(first: StepPrediction, last: StepPrediction) -> tuple:
    """(term, its share of the first step, its share of the last) for the term whose share grew most."""
    shares = {
        t: (first.terms[t] / first.step_time, last.terms[t] / last.step_time) for t in first.terms if t != "compute"
    }
    term = max(shares, key=lambda t: shares[t][1] - shares[t][0])
    return term, *shares[term]


def write_plan_json(path: Path, flags: Candidate, candidates: list[Candidate], scaling: list | None) -> int | None:
    """--plan_json: the flags' layout first, then every fitting layout fastest first; "recommended" indexes the
    fastest that fits (None: nothing fits). Returns that index."""
    fitting = [c for c in candidates if c.fits]
    layouts = [flags, *fitting]
    recommended = 1 if fitting else None  # the fastest fitting one follows the flags' layout
    if fitting and flags.fits and flags.prediction.step_time <= fitting[0].prediction.step_time:
        recommended = 0
    document = {"layouts": [c.as_dict() for c in layouts], "recommended": recommended}
    if scaling:
        document["scaling"] = [
            {
                "nodes": row["nodes"],
                "gpus": row["gpus"],
                "fixed_global_batch": row["fixed_global"] and row["fixed_global"].as_dict(),
                "fixed_per_gpu_batch": row["fixed_per_gpu"].as_dict(),
            }
            for row in scaling
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return recommended
