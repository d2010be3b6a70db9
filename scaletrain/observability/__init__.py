"""Observability: metrics sinks and timers, FLOPs and MFU, the communication log, the memory planner, evaluation
prompts.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.observability.comms_log import CommLog, comms_summary
from scaletrain.observability.eval_prompts import generate_samples, load_eval_prompts
from scaletrain.observability.goodput import GoodputLedger
from scaletrain.observability.host_memory import HostMemoryPhase
from scaletrain.observability.flops import ModelFlops, model_flops, throughput_model
from scaletrain.observability.long_context_plan import render_longest_blocks
from scaletrain.observability.memory_planner import (
    MemoryFeatures,
    ModelShape,
    OPTIMIZER_BYTES,
    auto_loss_chunk,
    plan_memory,
    render_memory_plan,
    weight_bytes,
)
from scaletrain.observability.metrics import (
    LogWindow,
    METRICS_FILE,
    MetricsLogger,
    PhaseClock,
    StepProfiler,
    ThroughputModel,
    describe_dry_run,
    read_records,
)

__all__ = [
    "CommLog",
    "GoodputLedger",
    "HostMemoryPhase",
    "comms_summary",
    "describe_dry_run",
    "LogWindow",
    "METRICS_FILE",
    "MetricsLogger",
    "ModelFlops",
    "MemoryFeatures",
    "ModelShape",
    "OPTIMIZER_BYTES",
    "PhaseClock",
    "StepProfiler",
    "ThroughputModel",
    "auto_loss_chunk",
    "generate_samples",
    "load_eval_prompts",
    "model_flops",
    "throughput_model",
    "plan_memory",
    "read_records",
    "render_longest_blocks",
    "render_memory_plan",
    "weight_bytes",
]
