"""The run's configuration: one frozen dataclass per concern composed in RunConfig, the flat command line and
recipes, the cross-slice checks, and the DeepSpeed JSON resolved from them (its schema included).

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.config.checks import check_rampup
from scaletrain.config.cli import explain_resolved, parse_run_config
from scaletrain.config.deepspeed_json import (
    DSKey,
    HardwareFacts,
    ModelSize,
    ResolvedDSConfig,
    bucket_elements,
    load_ds_config,
    assemble_ds_config,
    resolve_ds_config,
)
from scaletrain.config.run_config import RunConfig
from scaletrain.config.guards import HangArgs, NonFiniteArgs
from scaletrain.config.harness import HarnessArgs
from scaletrain.config.preference import LOSS_TYPES, REFERENCE_FREE_LOSSES, PreferenceArgs, check_preference_run
from scaletrain.config.planning import GPU, GPUS, PlanningArgs
from scaletrain.config.slices import DataArgs, ModelArgs, OptimArgs, ParallelArgs, PeftArgs
from scaletrain.config.values import (
    LOCAL_DATA_FORMATS,
    VALIDATION_SPLIT,
    eval_loss_set,
    eval_metric_prefix,
    expand_data_files,
)

__all__ = [
    "DataArgs",
    "DSKey",
    "HangArgs",
    "HardwareFacts",
    "HarnessArgs",
    "LOCAL_DATA_FORMATS",
    "LOSS_TYPES",
    "ModelArgs",
    "ModelSize",
    "NonFiniteArgs",
    "OptimArgs",
    "ParallelArgs",
    "PeftArgs",
    "GPU",
    "GPUS",
    "PlanningArgs",
    "PreferenceArgs",
    "REFERENCE_FREE_LOSSES",
    "ResolvedDSConfig",
    "RunConfig",
    "VALIDATION_SPLIT",
    "assemble_ds_config",
    "bucket_elements",
    "check_preference_run",
    "check_rampup",
    "eval_loss_set",
    "eval_metric_prefix",
    "expand_data_files",
    "explain_resolved",
    "load_ds_config",
    "parse_run_config",
    "resolve_ds_config",
]
