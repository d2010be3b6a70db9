"""--plan --plan_calibration RUN_DIR: the time model calibrated by a measured run on the machine to plan for. From the
run's folder: its metrics.jsonl (the steady steps' phases, the device peak behind its MFU), its flags
(run_config.json: block size, micro-batch, accumulation, layout), its DeepSpeed JSON (ZeRO stage), its comms log's
bus bandwidths where --comms_log was on, what train.py measures after its last step (micro_batch_probe.json: the
fixed cost of a micro-batch, the fused attention's rate at the run's shape), and scripts/gpu_check.sh's measured
matmul rate where gpu_check.json sits in or beside the folder. The model's own FLOP, byte and communication formulas
stay as they are; the run sets the machine's rates: the time of a micro-batch that does not grow with its tokens
(dispatch, launches, gradient hooks), attention's rate, how much slower than the FLOP model the rest of its compute
runs (the compute scale), its optimizer step, and what a step spends outside both (data, synchronisation). One run's
step time cannot tell a fixed cost or a slow kernel from a slower rate overall; the probe's tiny micro-batch, whose
FLOPs are negligible, and its attention kernel alone do. Formulas: docs/parallelism.md#time-model."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from scaletrain.config import GPU, ResolvedDSConfig
from scaletrain.errors import UsageError
from scaletrain.observability.memory_planner import ModelShape
from scaletrain.observability.metrics import METRICS_FILE, read_records
from scaletrain.observability.time_model import (
    NVLINK_EFFICIENCY,
    Cluster,
    Layout,
    compute_parts,
    compute_passes,
    predict_step,
    split_compute,
)
from scaletrain.parts import ParallelLayout

CPU_MEMORY_GBS = 20.0  # a CPU's memory bandwidth for the element-wise term of a calibrated CPU (a DDR channel pair)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
PROBE_FILE = "micro_batch_probe.json"


@dataclass(frozen=True)
class Calibration:
    """What a measured run says about its machine."""

    run_dir: Path
    layout: Layout
    block_size: int
    precision: str
    peak_tflops: float  # the device peak the run's MFU was computed against (a CPU: its measured matmul rate)
    phases: dict  # median seconds of the steady steps: step, forward, backward, pipeline, optimizer
    bus_gbs: float | None = None  # the comms log's latency-weighted bus bandwidth, GB/s
    matmul_tflops: float | None = None  # gpu_check.json's measured matmul rate
    micro_batch_fixed_s: float | None = None  # the probe's fixed time of one micro-batch (micro_batch_probe.json)
    attention_tflops: float | None = None  # the probe's fused-attention rate at the run's shape

    @property
    def world(self) -> int:
        return self.layout.parallel.world_size

    @property
    def compute_s(self) -> float:
        return self.phases["forward"] + self.phases["backward"] + self.phases["pipeline"]

    @property
    def overhead_s(self) -> float:
        """What a step spends outside compute and the optimizer: data wait, synchronisation, metrics."""
        return max(0.0, self.phases["step"] - self.compute_s - self.phases["optimizer"])


def _refuse(run_dir: Path, what: str) -> UsageError:
    return UsageError(
        f"--plan_calibration {run_dir}: {what}",
        "point it at a finished run's --output_dir (metrics.jsonl with a few logged steps, run_config.json)",
    )


def _read_json(path: Path, run_dir: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise _refuse(run_dir, f"cannot read {path.name} ({err.__class__.__name__})") from None


def read_calibration(run_dir: Path) -> Calibration:
    """The calibration in `run_dir`; a folder that is not a run, or a run without steady logged steps, is a
    UsageError naming --plan_calibration."""
    if not (run_dir / METRICS_FILE).is_file():
        raise _refuse(run_dir, f"no {METRICS_FILE}")
    flags = _read_json(run_dir / "run_config.json", run_dir)
    ds_path = run_dir / "ds_config.json"
    ds = ResolvedDSConfig.saved(_read_json(ds_path, run_dir), str(ds_path))
    records, _ = read_records(run_dir / METRICS_FILE)
    steps = [r for r in records if "step_time_s" in r and r.get("mfu")]
    if len(steps) < 4:
        raise _refuse(run_dir, f"{len(steps)} logged training steps with an MFU; need at least 4 (--logging_steps 1)")
    steady = steps[len(steps) // 4 :]  # the warm-up quarter left out
    median = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
    phases = {name: median(f"{name}_s") for name in ("forward", "backward", "pipeline", "optimizer")}
    phases["step"] = median("step_time_s")
    micro, accum = flags["per_device_train_batch_size"], flags["gradient_accumulation_steps"]
    tp, pp, sp = (flags.get(f"{kind}_parallel_size", 1) for kind in ("tensor", "pipeline", "sequence"))
    dp = max(1, round(median("global_batch") / (micro * accum)))
    offload_optimizer, offload_params = ds.offload_devices
    layout = Layout(
        ParallelLayout(tp=tp, sp=sp, pp=pp, dp=dp),
        zero_stage=ds.zero_stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        micro_batch=micro,
        grad_accum=accum,
        checkpointing=bool(flags.get("gradient_checkpointing")),
    )
    return Calibration(
        run_dir=run_dir,
        layout=layout,
        block_size=int(flags.get("block_size") or 0) or _block_size(steady, layout),
        precision=ds.precision,
        peak_tflops=median("tflops_per_device") / median("mfu"),
        phases=phases,
        bus_gbs=_bus_bandwidth(steady),
        matmul_tflops=_gpu_check_matmul(run_dir),
        **_probe(run_dir),
    )


def write_micro_batch_probe(run_dir: Path, seconds: float, tokens: int, attention_tflops: float | None) -> None:
    """Record what train.py measured after its last step: the fixed cost of a micro-batch
    (train.step.micro_batch_fixed_seconds) and the fused attention's rate at the run's shape
    (flops.measured_attention_tflops)."""
    probe = {"fixed_seconds_per_micro_batch": seconds, "probe_tokens": tokens, "attention_tflops": attention_tflops}
    (Path(run_dir) / PROBE_FILE).write_text(json.dumps(probe, indent=2) + "\n")


def _probe(run_dir: Path) -> dict:
    """The Calibration fields of the run's probe; none where it has none (a pipeline, sequence-parallel or
    preference run, a compiled one, or one that never finished)."""
    path = run_dir / PROBE_FILE
    if not path.is_file():
        return {}
    probe = _read_json(path, run_dir)
    return {
        "micro_batch_fixed_s": float(probe["fixed_seconds_per_micro_batch"]),
        "attention_tflops": probe["attention_tflops"] and float(probe["attention_tflops"]),
    }


def _block_size(records: list, layout: Layout) -> int:
    """The tokens of a block, from the tokens a step trains (--block_size left to the model's default)."""
    tokens = statistics.median(r["tokens_per_s"] * r["step_time_s"] for r in records)
    return round(tokens / (layout.micro_batch * layout.grad_accum * layout.parallel.dp))


def _bus_bandwidth(records: list) -> float | None:
    """The latency-weighted bus bandwidth of the collectives the comms log recorded, GB/s (None: no comms log)."""
    weighted = milliseconds = 0.0
    for record in records:
        for kind in COLLECTIVES:
            ms = record.get(f"comm_{kind}_ms", 0.0)
            weighted += record.get(f"comm_{kind}_busbw_gbps", 0.0) * ms
            milliseconds += ms
    return weighted / milliseconds / 8 if milliseconds else None


def _gpu_check_matmul(run_dir: Path) -> float | None:
    for path in (run_dir / "gpu_check.json", run_dir.parent / "gpu_check.json"):
        if path.is_file():
            measured = json.loads(path.read_text()).get("machine", {}).get("measured_matmul_tflops")
            if measured:
                return float(measured)
    return None


def calibrated_gpu(calibration: Calibration, memory_gb: float) -> GPU:
    """The run's device as the time model sees it when no --gpu names it: its measured peak with every compute
    term at that rate, a CPU's memory bandwidth for the element-wise kernels (the compute scale corrects both)."""
    return GPU(
        name=f"calibrated by {calibration.run_dir.name}",
        peak_tflops=calibration.matmul_tflops or calibration.peak_tflops,
        memory_gb=memory_gb,
        hbm_gbs=CPU_MEMORY_GBS,
        nvlink_gbs=(calibration.bus_gbs or 1.0) / NVLINK_EFFICIENCY,
        matmul_efficiency=1.0,
        attention_efficiency=1.0,
        source=f"measured: {calibration.run_dir}",
    )


def calibrate(cluster: Cluster, calibration: Calibration, shape: ModelShape) -> Cluster:
    """`cluster` with the run's rates: the fixed cost of a micro-batch (the probe's, per layer), the compute scale
    (measured forward + backward over the model's compute for the run's own shape and layout, model-parallel traffic
    and the micro-batches' fixed cost taken out), the optimizer scale, the per-step overhead, the measured bus
    bandwidth inside a node, and gpu_check's matmul rate as the achievable fraction of the peak. `shape` is the
    calibrated run's model."""
    layout = calibration.layout
    if calibration.matmul_tflops:
        cluster = replace(cluster, matmul_efficiency=min(1.0, calibration.matmul_tflops * 1e12 / cluster.peak_flops))
    if calibration.bus_gbs:
        cluster = replace(cluster, intra_node_gbs=calibration.bus_gbs / NVLINK_EFFICIENCY)
    if calibration.micro_batch_fixed_s is not None:  # the probe ran the run's model, recomputation included
        per_layer = calibration.micro_batch_fixed_s / (shape.layers / layout.parallel.pp) * 3 / compute_passes(layout)
        cluster = replace(cluster, micro_batch_fixed_s_per_layer=per_layer)
    if calibration.attention_tflops:
        cluster = replace(cluster, attention_efficiency=calibration.attention_tflops * 1e12 / cluster.peak_flops)
    nominal = predict_step(
        shape, seq_len=calibration.block_size, layout=layout, cluster=cluster, precision=calibration.precision
    )
    terms = nominal.terms
    traffic = terms["tensor_parallel"] + terms["sequence_parallel"] + terms["pipeline_p2p"]
    value_bytes = 4 if calibration.precision == "fp32" else 2
    scaled, measured = split_compute(
        compute_parts(shape, seq_len=calibration.block_size, layout=layout, cluster=cluster, value_bytes=value_bytes),
        cluster,
    )
    # the bubble is compute's (P - 1) / m; what the run measured holds both
    bubble = 1 + (terms["pipeline_bubble"] / terms["compute"] if terms["compute"] else 0.0)
    m = layout.grad_accum
    to_scale = max(calibration.compute_s - traffic - m * measured * bubble, 0.1 * m * scaled * bubble)
    optimizer_scale = calibration.phases["optimizer"] / terms["optimizer"] if terms["optimizer"] else 1.0
    return replace(
        cluster,
        compute_scale=to_scale / (m * scaled * bubble) if scaled else 1.0,
        optimizer_scale=optimizer_scale,
        step_overhead_s=calibration.overhead_s,
    )


def describe_calibration(calibration: Calibration, cluster: Cluster) -> str:
    """The line --plan prints above a calibrated time plan."""
    phases = calibration.phases
    return (
        f"calibrated by {calibration.run_dir} ({calibration.world} rank(s), {calibration.block_size}-token blocks, "
        f"micro-batch {calibration.layout.micro_batch} x {calibration.layout.grad_accum}): step {phases['step']:.3g} "
        f"s, compute {calibration.compute_s:.3g} s = {cluster.compute_scale:.2f}x the FLOP model at "
        f"{calibration.peak_tflops:.3g} TFLOP/s, optimizer {phases['optimizer']:.3g} s, other "
        f"{calibration.overhead_s:.3g} s a step"
        + _probe_part(calibration)
        + ("" if calibration.bus_gbs is None else f", bus bandwidth {calibration.bus_gbs:.3g} GB/s (comms log)")
        + ("" if calibration.matmul_tflops is None else f", matmul {calibration.matmul_tflops:g} TFLOP/s (gpu_check)")
    )


def _probe_part(calibration: Calibration) -> str:
    fixed, attention = calibration.micro_batch_fixed_s, calibration.attention_tflops
    return ("" if fixed is None else f", fixed {fixed * 1e3:.3g} ms a micro-batch (probe)") + (
        "" if attention is None else f", attention {attention:.3g} TFLOP/s (probe)"
    )
