"""The keys a DeepSpeed JSON may hold, so that a misspelling fails at once with a did-you-mean.

DeepSpeed ignores an unknown top-level key without a word, and rejects an unknown nested key only deep inside
deepspeed.initialize, after the model is built. Sections DeepSpeed describes with pydantic models take their key
names (and aliases) from those models, so they follow the installed DeepSpeed; the rest are listed here from
DeepSpeed 0.19's config reference. Sections with free-form contents (optimizer params of exotic optimizers,
compression and data-efficiency recipes) are checked by name only.
"""

from __future__ import annotations

import difflib

from scaletrain.errors import UsageError

TOP_LEVEL_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "amp",
    "torch_autocast",
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "data_types",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "memory_breakdown",
    "log_level",
    "disable_allgather",
    "dataloader_drop_last",
    "flops_profiler",
    "activation_checkpointing",
    "aio",
    "comms_logger",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "elasticity",
    "autotuning",
    "checkpoint",
    "data_efficiency",
    "curriculum_learning",
    "compression_training",
    "sparse_attention",
    "pipeline",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "weight_quantization",
    "hybrid_engine",
    "compile",
    "tensor_parallel",
    "timers",
    "nebula",
    "graph_harvesting",
    "use_data_before_expert_parallel_",
    "expert_parallel",
    "gradient_allreduce_op",
    "managed_gradient_accumulation",
    "disable_python_gc",
    "legacy_fusion",
    "vocabulary_size",
    "max_grad_norm",
    "sequence_parallel_size",
    "zenflow",
}

_FIXED_SECTIONS = {
    "optimizer": {"type", "params", "legacy_fusion"},
    "aio": {
        "block_size",
        "queue_depth",
        "intra_op_parallelism",
        "thread_count",
        "single_submit",
        "overlap_events",
        "use_gds",
    },
    "activation_checkpointing": {
        "partition_activations",
        "contiguous_memory_optimization",
        "cpu_checkpointing",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    },
    "flops_profiler": {
        "enabled",
        "recompute_fwd_factor",
        "profile_step",
        "module_depth",
        "top_modules",
        "detailed",
        "output_file",
    },
    "checkpoint": {"tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer"},
    "data_types": {"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"},
}
ADAM_PARAMS = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "torch_adam",
    "adam_w_mode",
    "fp32_optimizer_states",
    "amsgrad",
    "bias_correction",
    "fused",
    "foreach",
}
OPTIMIZER_TYPES = {
    "adam",
    "adamw",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "lamb",
    "lion",
    "adagrad",
    "sgd",
    "muadam",
    "muadamw",
    "musgd",
    "muon",
    "adam_8bit",
    "cpu_adam",
}


def _model_keys(model_cls) -> set:
    keys = set()
    for name, field in model_cls.model_fields.items():
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return keys


def _pydantic_sections() -> dict:
    """Key sets of the sections DeepSpeed validates with pydantic models, found through engine/ds_internals (the
    one place that touches DeepSpeed's internals; imported lazily: deepspeed is heavy)."""
    from scaletrain.engine import deepspeed_config_models

    return {section: _model_keys(model) for section, model in deepspeed_config_models().items()}


def _unknown(keys, known: set, where: str, path: str) -> UsageError | None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f'did you mean "{close[0]}"?' if close else f"known keys here: {', '.join(sorted(known))}"
            return UsageError(f'unknown key "{where}{key}" in {path}', hint)
    return None


def check_ds_keys(raw: dict, path: str) -> None:
    """Raise UsageError naming the first unknown key, at any level with a known schema."""
    schemas = {**_FIXED_SECTIONS, **_pydantic_sections()}
    error = _unknown(raw, TOP_LEVEL_KEYS, "", path)
    if error:
        raise error
    for section, known in schemas.items():
        node: object = raw
        for part in section.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            error = _unknown(node, known, f"{section}.", path)
            if error:
                raise error
        elif node is not None and not isinstance(node, dict) and section not in ("bfloat16",):
            raise UsageError(f'"{section}" in {path} must be a JSON object, not {type(node).__name__}')
    optimizer = raw.get("optimizer")
    if isinstance(optimizer, dict):
        kind = str(optimizer.get("type", "")).lower()
        if kind and kind not in OPTIMIZER_TYPES:
            close = difflib.get_close_matches(kind, sorted(OPTIMIZER_TYPES), n=1)
            raise UsageError(
                f'optimizer.type "{optimizer.get("type")}" in {path} is not a DeepSpeed optimizer',
                f'did you mean "{close[0]}"?' if close else "use AdamW, Adam, Lamb, Lion or SGD",
            )
        params = optimizer.get("params", {})
        if kind in ("adam", "adamw") and isinstance(params, dict):
            error = _unknown(params, ADAM_PARAMS, "optimizer.params.", path)
            if error:
                raise error
