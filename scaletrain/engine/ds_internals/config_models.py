"""DeepSpeed's pydantic config models: their field names (and aliases) are the keys a section of a DeepSpeed JSON
may hold, so the schema check (config/deepspeed_schema.py) follows the installed DeepSpeed. Imported from their
modules only when asked for, like every hook."""

from __future__ import annotations

from scaletrain.engine.ds_internals.guard import Hook

_PURPOSE = "checking the keys of a DeepSpeed JSON before anything is built"


def _is_pydantic_model(value) -> str | None:
    return None if isinstance(getattr(value, "model_fields", None), dict) else "is not a pydantic model"


def _model(module: str, name: str) -> Hook:
    return Hook(module, name, _PURPOSE, problem=_is_pydantic_model)


# JSON section -> the model that validates it.
CONFIG_MODELS = {
    "zero_optimization": _model("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "zero_optimization.offload_param": _model(
        "deepspeed.runtime.zero.offload_config", "DeepSpeedZeroOffloadParamConfig"
    ),
    "zero_optimization.offload_optimizer": _model(
        "deepspeed.runtime.zero.offload_config", "DeepSpeedZeroOffloadOptimizerConfig"
    ),
    "bf16": _model("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "bfloat16": _model("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "fp16": _model("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "tensorboard": _model("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": _model("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": _model("deepspeed.monitor.config", "CSVConfig"),
    "comet": _model("deepspeed.monitor.config", "CometConfig"),
}


def deepspeed_config_models() -> dict:
    """{JSON section: DeepSpeed's pydantic model class for it}, each checked (DeepSpeedInternalsMoved if moved)."""
    return {section: hook.resolve() for section, hook in CONFIG_MODELS.items()}
