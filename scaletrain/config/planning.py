"""--plan's flags (the cluster to plan for) and the GPU presets they name: datasheet facts and the published fraction
of each GPU's peak that training kernels reach (the time model, scaletrain/observability/time_model.py, reads them).
Slices as in scaletrain/config/slices.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scaletrain.config.slices import _flag
from scaletrain.config.values import _check_at_least_one
from scaletrain.errors import UsageError


@dataclass(frozen=True)
class GPU:
    """One GPU model's datasheet facts and the published fraction of its peak that training kernels reach."""

    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core peak, TFLOP/s (no sparsity)
    memory_gb: float
    hbm_gbs: float  # memory bandwidth, GB/s
    nvlink_gbs: float  # NVLink bandwidth per GPU, one direction, GB/s
    matmul_efficiency: float  # achievable fraction of the peak on large matrix products (MAMF)
    attention_efficiency: float  # fraction of the peak FlashAttention reaches forward + backward
    source: str


GPUS = {
    "v100-32gb": GPU(
        "v100-32gb",
        peak_tflops=125.0,
        memory_gb=32.0,
        hbm_gbs=900.0,
        nvlink_gbs=150.0,
        matmul_efficiency=0.75,
        attention_efficiency=0.35,
        source="NVIDIA V100 SXM2 datasheet (125 TFLOP/s fp16, 900 GB/s HBM2, NVLink 300 GB/s both ways); "
        "matmul fraction: "
        "cuBLAS fp16 GEMMs reach ~90-95 TFLOP/s (NVIDIA Deep Learning Performance Guide); attention: no "
        "FlashAttention-2 on Volta, memory-efficient attention (xFormers) at about a third of the peak",
    ),
    "a100-40gb": GPU(
        "a100-40gb",
        peak_tflops=312.0,
        memory_gb=40.0,
        hbm_gbs=1555.0,
        nvlink_gbs=300.0,
        matmul_efficiency=0.80,
        attention_efficiency=0.60,
        source="NVIDIA A100 SXM4 40GB datasheet (312 TFLOP/s bf16 dense, 1555 GB/s, NVLink 600 GB/s both "
        "ways); matmul: "
        "Bekman's ML Engineering MAMF table, A100 SXM bf16 267.9 TFLOP/s (86%) at the best shape, 80% for "
        "training shapes; attention: FlashAttention-2 fwd+bwd 50-73% of peak on A100 (Dao 2023, fig. 4)",
    ),
    "a100-80gb": GPU(
        "a100-80gb",
        peak_tflops=312.0,
        memory_gb=80.0,
        hbm_gbs=2039.0,
        nvlink_gbs=300.0,
        matmul_efficiency=0.80,
        attention_efficiency=0.60,
        source="NVIDIA A100 SXM4 80GB datasheet (312 TFLOP/s bf16 dense, 2039 GB/s, NVLink 600 GB/s both "
        "ways); efficiencies "
        "as a100-40gb",
    ),
    "h100-sxm": GPU(
        "h100-sxm",
        peak_tflops=989.0,
        memory_gb=80.0,
        hbm_gbs=3350.0,
        nvlink_gbs=450.0,
        matmul_efficiency=0.75,
        attention_efficiency=0.55,
        source="NVIDIA H100 SXM5 datasheet (989 TFLOP/s bf16 dense, 3.35 TB/s, NVLink 900 GB/s both ways); "
        "matmul: Bekman's "
        "MAMF table, H100 SXM bf16 792 TFLOP/s (80%) at the best shape, 75% for training shapes; attention: "
        "FlashAttention-3 bf16 fwd 600-740 TFLOP/s, bwd lower (Shah et al. 2024), ~55% fwd+bwd",
    ),
    "h200": GPU(
        "h200",
        peak_tflops=989.0,
        memory_gb=141.0,
        hbm_gbs=4800.0,
        nvlink_gbs=450.0,
        matmul_efficiency=0.75,
        attention_efficiency=0.55,
        source="NVIDIA H200 SXM datasheet (989 TFLOP/s bf16 dense, 141 GB, 4.8 TB/s, NVLink 900 GB/s both "
        "ways); the H100's "
        "compute die, efficiencies as h100-sxm",
    ),
}


@dataclass(frozen=True)
class PlanningArgs:
    """--plan, the memory and time planner: the cluster to plan for."""

    plan: bool = _flag(
        False,
        "Planner: per-GPU memory of each ZeRO stage and offload option for the model (built on the meta device) on "
        "--num_nodes x --num_gpus GPUs, then every layout's predicted step time, the fastest that fits "
        "recommended; exit.",
    )
    num_gpus: int = _flag(1, "--plan: GPUs per node (also --gpus_per_node).", aliases=("--gpus_per_node",))
    num_nodes: int = _flag(1, "--plan: nodes.")
    gpu: str = _flag(
        "h100-sxm",
        "--plan: the GPU, a preset with its datasheet peak, memory and NVLink bandwidth: "
        "v100-32gb, a100-40gb, a100-80gb, h100-sxm, h200 (its memory unless --gpu_memory_gb is given).",
    )
    gpu_memory_gb: float | None = _flag(None, "--plan: memory of one GPU, GB (default: --gpu's).")
    gpu_peak_tflops: float | None = _flag(None, "--plan: dense 16-bit peak TFLOP/s of one GPU (default: --gpu's).")
    intra_node_gbps: float | None = _flag(
        None, "--plan: GB/s each way between the GPUs of a node, per GPU (default: --gpu's NVLink; H100: 450)."
    )
    inter_node_gbps: float = _flag(
        1600.0, "--plan: the network of one node, Gbit/s (8 x 200 Gb/s HDR InfiniBand = 1600; 8 x 400 NDR = 3200)."
    )
    host_memory_gb: float | None = _flag(None, "--plan: host memory per node for offload, GB (default: unchecked).")
    plan_precision: str = _flag("bf16", "--plan: training precision to plan for.", choices=("bf16", "fp16", "fp32"))
    plan_tokens: float | None = _flag(None, "--plan: tokens to train, for the days each layout takes (e.g. 1e12).")
    plan_json: str | None = _flag(None, "--plan: also write the plan as JSON to this file (layouts, recommended).")
    plan_calibration: str | None = _flag(
        None,
        "--plan: a finished run's --output_dir on the machine to plan for; its measured phases (and its probe of a "
        "micro-batch's fixed cost and attention's rate, comms log, gpu_check.json beside it) set the time model's "
        "rates; without --gpu, plans that machine and world size.",
    )
    plan_scaling: str | None = _flag(
        None, "--plan: node counts (e.g. 1,2,4,8) to predict tokens/s, speed-up and efficiency at, and what grows."
    )

    def validate(self) -> None:
        if not self.plan:
            return
        _check_at_least_one(self, ("num_gpus", "num_nodes"))
        for name in ("gpu_memory_gb", "host_memory_gb", "gpu_peak_tflops", "intra_node_gbps", "inter_node_gbps",
                     "plan_tokens"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UsageError(f"--{name} {getattr(self, name)}: must be positive")
        if self.gpu not in GPUS:
            raise UsageError(
                f"--gpu {self.gpu}: unknown GPU; known: {', '.join(GPUS)}",
                "pick the nearest and set --gpu_peak_tflops, --gpu_memory_gb and --intra_node_gbps to yours",
            )
        self.scaling_nodes()
        if self.plan_calibration and not Path(self.plan_calibration).is_dir():
            raise UsageError(
                f"--plan_calibration {self.plan_calibration}: no such folder",
                "point it at a finished run's --output_dir",
            )

    @property
    def memory_gb(self) -> float:
        """One GPU's memory: --gpu_memory_gb, or --gpu's."""
        return self.gpu_memory_gb or GPUS[self.gpu].memory_gb

    def scaling_nodes(self) -> list[int]:
        """--plan_scaling's node counts, ascending ([] without it)."""
        if not self.plan_scaling:
            return []
        try:
            counts = [int(n) for n in self.plan_scaling.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            raise UsageError(
                f"--plan_scaling {self.plan_scaling}: not a list of node counts", "e.g. --plan_scaling 1,2,4,8"
            )
        return sorted(set(counts))
