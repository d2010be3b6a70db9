"""Observability: metrics sinks and timers, FLOPs and MFU, the communication log, the memory planner, evaluation
prompts.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.observability.calibration import read_calibration, write_micro_batch_probe
from scaletrain.observability.comms_log import CommLog, comms_summary
from scaletrain.observability.eval_prompts import EvalPrompts, PromptSamples, load_eval_prompts
from scaletrain.observability.goodput import GoodputLedger
from scaletrain.observability.host_memory import CgroupMemory, HostMemoryPhase
from scaletrain.observability.flops import (
    ModelFlops,
    attention_heads,
    measured_attention_tflops,
    model_flops,
    throughput_model,
)
from scaletrain.observability.memory_planner import (
    ModelShape,
    OPTIMIZER_BYTES,
    auto_loss_chunk,
    snapshot_bytes_per_rank,
    weight_bytes,
)
from scaletrain.observability.plan_report import print_memory_plan
from scaletrain.observability.metrics import (
    MetricsLogger,
    PHASES,
    PhaseClock,
    RunIdentity,
    ThroughputModel,
    describe_dry_run,
    memory_stats,
)

__all__ = [
    "read_calibration",
    "write_micro_batch_probe",
    "CgroupMemory",
    "CommLog",
    "EvalPrompts",
    "GoodputLedger",
    "HostMemoryPhase",
    "comms_summary",
    "describe_dry_run",
    "MetricsLogger",
    "PHASES",
    "RunIdentity",
    "memory_stats",
    "ModelFlops",
    "ModelShape",
    "PromptSamples",
    "OPTIMIZER_BYTES",
    "PhaseClock",
    "ThroughputModel",
    "auto_loss_chunk",
    "load_eval_prompts",
    "model_flops",
    "attention_heads",
    "measured_attention_tflops",
    "throughput_model",
    "print_memory_plan",
    "snapshot_bytes_per_rank",
    "weight_bytes",
]
