"""The run's parallel layout (parts.ParallelLayout: which ranks form each tensor-, sequence-, pipeline- and
data-parallel group) set on the launch, and checked against the world size, the model and the DeepSpeed config
before anything is built. Tensor parallelism is DeepSpeed AutoTP (the model's own TP plan where it has one),
sequence parallelism DeepSpeed Ulysses (sequence_parallel.py), pipeline parallelism deepspeed.pipe (pipeline.py).
Imports no torch.
"""

from __future__ import annotations

import dataclasses

from scaletrain.config import DSKey, ParallelArgs, PlanningArgs, ResolvedDSConfig
from scaletrain.distributed.pipeline import check_pipeline_model
from scaletrain.errors import UsageError
from scaletrain.parts import DistInfo, ParallelLayout, ulysses_split_problem

# The model dimensions a tensor-parallel split divides (Llama-family names; models without them are not checked).
_SPLIT_DIMENSIONS = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("intermediate_size", "MLP width"),
    ("vocab_size", "vocabulary"),
)


_SIZE_FLAGS = (
    ("tensor_parallel_size", "tp"),
    ("sequence_parallel_size", "sp"),
    ("pipeline_parallel_size", "pp"),
)
# Combinations of model-parallel kinds that do not run yet, each with the reason (TP x PP and TP x SP run, with DP
# over them).
_NOT_COMPOSED = {
    frozenset(("sp", "pp")): "the pipeline's stages pass whole blocks, and Ulysses' all-to-alls would have to run "
    "inside every stage with the sequence shards between stages",
}


def _chosen_sizes(parallel: ParallelArgs) -> list:
    """[(flag, size)] of each model-parallel kind the run asks for (size > 1)."""
    return [(f"--{name}", getattr(parallel, name)) for name, _ in _SIZE_FLAGS if getattr(parallel, name) > 1]


def check_composition(parallel: ParallelArgs) -> None:
    """Tensor x pipeline and tensor x sequence parallelism (with data parallelism over them) compose; sequence with
    pipeline parallelism does not yet: one line naming the combination and why."""
    axes = {axis for name, axis in _SIZE_FLAGS if getattr(parallel, name) > 1}
    for pair, reason in _NOT_COMPOSED.items():
        if pair <= axes:
            flags = " with ".join(f"{flag} {size}" for flag, size in _chosen_sizes(parallel))
            raise UsageError(
                f"{flags}: sequence parallelism does not compose with pipeline parallelism yet ({reason})",
                "use --sequence_parallel_size with tensor and data parallelism, or drop it "
                "(tensor x pipeline x data parallelism composes)",
            )


def apply_layout(parallel: ParallelArgs, dist: DistInfo) -> DistInfo:
    """`dist` with the layout set (its dp_world_size and dp_rank follow): the world must split into the product
    of the model-parallel sizes, and the kinds must compose."""
    check_composition(parallel)
    chosen = _chosen_sizes(parallel)
    product = 1
    for _, size in chosen:
        product *= size
    if dist.world_size % product:
        named = " x ".join(f"{flag} {size}" for flag, size in chosen)
        raise UsageError(
            f"{named} does not divide the world size {dist.world_size}"
            + (f" (their product is {product})" if len(chosen) > 1 else ""),
            f"launch a multiple of {product} ranks, or choose sizes whose product divides {dist.world_size}",
        )
    layout = ParallelLayout.of_world(
        dist.world_size, parallel.tensor_parallel_size, parallel.sequence_parallel_size, parallel.pipeline_parallel_size
    )
    return dataclasses.replace(dist, layout=layout)


# The model-parallel axes of a layout, each with its name in the log.
_MODEL_AXES = (("tp", "tensor"), ("sp", "sequence"), ("pp", "pipeline"))
_GROUPS_SHOWN = 4  # groups named per axis in the launch line; the rest are counted


def rank_ranges(ranks) -> str:
    """0-3 for consecutive ranks, else 0,2,4 (a group's, or a host's in the launch line)."""
    consecutive = len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1
    return f"{ranks[0]}-{ranks[-1]}" if consecutive else ",".join(map(str, ranks))


def _placed(group: tuple, hosts: list) -> str:
    """A group's ranks and the hosts they run on: 0-1@n1, or 0,2@n1+n2 where it spans hosts."""
    return f"{rank_ranges(group)}@{'+'.join(dict.fromkeys(hosts[r] for r in group))}"


def describe_groups(layout: ParallelLayout, hosts: list) -> str:
    """Each model-parallel axis in use with its groups and their hosts, as the launch line shows them:
    "tensor groups 0-1@n1, 2-3@n2; pipeline groups 0,2@n1+n2, 1,3@n1+n2" ('' for data parallelism alone).
    `hosts`: each rank's host, in rank order."""
    parts = []
    for axis, name in _MODEL_AXES:
        if getattr(layout, axis) > 1:
            groups = layout.groups(axis)
            shown = ", ".join(_placed(g, hosts) for g in groups[:_GROUPS_SHOWN])
            more = f" and {len(groups) - _GROUPS_SHOWN} more" if len(groups) > _GROUPS_SHOWN else ""
            parts.append(f"{name} groups {shown}{more}")
    return "; ".join(parts)


def check_tensor_groups_within_nodes(layout: ParallelLayout, hosts: list, *, allow_cross_node: bool) -> None:
    """A tensor-parallel group whose ranks landed on more than one host is refused (its all-reduces, two per layer
    each way, would cross the network), unless --allow_cross_node_tensor_parallel (`allow_cross_node`). `hosts`:
    each rank's host."""
    if layout.tp == 1 or allow_cross_node:
        return
    groups = layout.groups("tp")
    spanning = [g for g in groups if len({hosts[r] for r in g}) > 1]
    if spanning:
        counts = sorted({hosts.count(h) for h in set(hosts)})
        per_node = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
        raise UsageError(
            f"--tensor_parallel_size {layout.tp}: tensor group {_placed(spanning[0], hosts)} spans nodes "
            f"({len(spanning)} of {len(groups)} groups do), so its all-reduces would cross the network",
            f"launch a multiple of {layout.tp} ranks on each node (this launch has {per_node} per node), or pass "
            "--allow_cross_node_tensor_parallel if the fabric between nodes is fast enough",
        )


def place_ranks(parallel: ParallelArgs, planning: PlanningArgs, dist: DistInfo) -> tuple[DistInfo, ParallelLayout]:
    """(this launch's ranks with the run's layout, the layout the run's checks are made on). --plan plans the
    cluster it names, not this launch: there the launch keeps its own ranks, and the layout is the planned
    cluster's, which the sizes must fit."""
    if planning.plan:
        return dist, planned_layout(parallel, planning)
    dist = apply_layout(parallel, dist)
    return dist, dist.layout


def planned_layout(parallel: ParallelArgs, planning: PlanningArgs) -> ParallelLayout:
    """--plan with a layout: tensor-parallel groups must fit inside a node of the planned cluster (or, with
    --allow_cross_node_tensor_parallel, span whole nodes), the layout must split its ranks; the planned cluster's
    layout."""
    tp, sp, pp = parallel.tensor_parallel_size, parallel.sequence_parallel_size, parallel.pipeline_parallel_size
    per_node, across = planning.num_gpus, parallel.allow_cross_node_tensor_parallel
    if per_node % tp and not (across and tp % per_node == 0):
        raise UsageError(
            f"--tensor_parallel_size {tp} does not divide --num_gpus {per_node}"
            + (f" nor span whole nodes of {per_node}" if across else ""),
            "a tensor-parallel group stays inside a node: choose a size that divides the GPUs per node"
            + (f", or a multiple of {per_node}" if across else ", or pass --allow_cross_node_tensor_parallel"),
        )
    ranks = planning.num_gpus * planning.num_nodes
    if ranks % (tp * sp * pp):
        raise UsageError(
            f"the layout (tensor {tp} x sequence {sp} x pipeline {pp}) does not divide the {ranks} planned GPUs",
            "choose sizes whose product divides --num_gpus x --num_nodes",
        )
    return ParallelLayout.of_world(ranks, tp, sp, pp)


def check_model_layout(layout: ParallelLayout, model_config) -> None:
    """Every dimension the tensor-parallel split cuts must divide evenly (a rank with no attention head, or uneven
    shards, is a silent waste or an error deep inside DeepSpeed); Ulysses splits each tensor rank's heads again.
    Pipeline stages cut between layers (pipeline.py checks them)."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    tp = layout.tp
    for name, what in _SPLIT_DIMENSIONS if tp > 1 else ():  # AutoTP splits every linear layer
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value % tp:
            raise UsageError(
                f"--tensor_parallel_size {tp}: the model's {value} {what} ({name}) do not split into {tp} equal parts",
                f"choose a size that divides {value}",
            )
    if layout.sp > 1:
        _check_ulysses_heads(layout.sp, text_config, tp)


def _check_ulysses_heads(sp: int, text_config, tp: int = 1) -> None:
    """Ulysses splits each tensor rank's heads over the sequence group (parts.ulysses_split_problem)."""
    heads = getattr(text_config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    local, local_kv = heads // tp, kv_heads // tp
    per_rank = f" ({local} on each of --tensor_parallel_size {tp} ranks)" if tp > 1 else ""
    kv_per_rank = f" ({local_kv} on each of --tensor_parallel_size {tp} ranks)" if tp > 1 else ""
    problem = ulysses_split_problem(local, local_kv, sp)
    if problem == "heads":
        raise UsageError(
            f"--sequence_parallel_size {sp}: the model's {heads} attention heads (num_attention_heads){per_rank} do "
            f"not split into {sp} equal parts",
            f"choose a size that divides {heads}" if tp == 1 else f"choose sizes whose product divides {heads}",
        )
    if problem == "kv_heads":
        raise UsageError(
            f"--sequence_parallel_size {sp}: the model's {kv_heads} key/value heads (num_key_value_heads)"
            f"{kv_per_rank} neither split into {sp} parts nor repeat evenly over {sp} ranks",
            f"choose a size that divides {local_kv} or is a multiple of it (and divides {local})",
        )


# The attention backends Ulysses wraps here: SDPA (documents isolated by our per-document attention) and
# FlashAttention 2/3 (documents isolated by transformers from the gathered position ids, on a GPU only).
ULYSSES_BACKENDS = ("sdpa", "flash_attention_2", "flash_attention_3")


def check_sequence_layout(layout: ParallelLayout, block_size: int, attn_implementation: str, accelerator: str) -> None:
    """Ulysses cuts every block into equal shards and wraps the model's SDPA or FlashAttention."""
    sp = layout.sp
    if sp == 1:
        return
    if block_size % sp:
        raise UsageError(
            f"--sequence_parallel_size {sp} does not divide the block size {block_size}",
            f"choose a --block_size that is a multiple of {sp}",
        )
    if attn_implementation not in ULYSSES_BACKENDS:
        raise UsageError(
            f"--sequence_parallel_size {sp}: the model's attention is {attn_implementation!r}, and "
            "DeepSpeed Ulysses wraps SDPA or FlashAttention here (eager attention needs a 4D mask it drops)",
            "pass --attn_implementation sdpa (or flash_attention_2 on a GPU)",
        )
    if attn_implementation.startswith("flash_attention") and accelerator != "cuda":
        raise UsageError(
            f"--sequence_parallel_size {sp} with --attn_implementation {attn_implementation}: FlashAttention "
            f"runs on CUDA GPUs, and this run's accelerator is {accelerator}",
            "pass --attn_implementation sdpa",
        )


def layout_ds_keys(layout: ParallelLayout, ds: ResolvedDSConfig, config_path: str) -> tuple[DSKey, ...]:
    """The keys the layout contributes to the DeepSpeed config (its tensor_parallel section and
    sequence_parallel_size; config.assemble_ds_config writes them), refusing the combinations of the layout and
    the resolved JSON `ds` that are not supported, with the reason."""
    tp = layout.tp
    section = ds.config.get("tensor_parallel")
    section = section if isinstance(section, dict) else {}
    in_json = section.get("autotp_size")
    if in_json not in (None, 0, 1, "auto", tp):
        raise UsageError(
            f"tensor_parallel.autotp_size {in_json} in {config_path} contradicts --tensor_parallel_size {tp}",
            "remove the key and pass --tensor_parallel_size",
        )
    keys = _sequence_layout_keys(layout.sp, ds, config_path)
    _check_pipeline_config(layout.pp, ds, config_path)
    if tp == 1:
        return keys
    if ds.offloads_optimizer or ds.offloads_params:
        raise UsageError(
            f"--tensor_parallel_size {tp} with offload ({config_path}): not supported here (untested)",
            "use ds_configs/zero1.json or zero2.json with tensor parallelism",
        )
    if section.get("vocab_parallel_lm_head") is True:
        raise UsageError(
            f"tensor_parallel.vocab_parallel_lm_head in {config_path}: the pipeline's loss needs the "
            "logits of the whole vocabulary on every rank",
            "remove the key",
        )
    keys += (DSKey("tensor_parallel.autotp_size", tp, "--tensor_parallel_size"),)
    if layout.pp > 1:
        keys += (_tensor_stages_key(section, config_path),)
    # With tied embeddings AutoTP would switch to a vocabulary-parallel head by itself (logits of half the
    # vocabulary per rank); the pipeline's token-weighted loss is computed from the whole logits.
    return (
        *keys,
        DSKey("tensor_parallel.vocab_parallel_lm_head", False, "tensor parallelism: the loss reads whole logits"),
    )


# How AutoTP splits a pipeline stage's decoder layers (Llama, Mistral and Qwen2 names: pipeline.TENSOR_STAGES):
# attention heads and MLP columns over the tensor-parallel group, the output projections by rows (their all-reduce
# sums the shards); the embedding, norms and head stay whole on every rank. By pattern, since the model's own TP
# plan names layers "model.layers.N..." and a stage's are "N.layer...".
TENSOR_STAGE_PARTITION = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.mlp\.(gate|up)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    ],
}


def _tensor_stages_key(section: dict, config_path: str) -> DSKey:
    """Tensor x pipeline parallelism: AutoTP splits each stage's layers by the pipeline's own parameter names."""
    for key in ("partition_config", "preset_model"):
        if section.get(key) is not None:
            raise UsageError(
                f"tensor_parallel.{key} in {config_path} with --tensor_parallel_size and --pipeline_parallel_size: "
                "the stages' layers are split by the pipeline's own parameter names",
                "remove the key",
            )
    return DSKey(
        "tensor_parallel.partition_config", TENSOR_STAGE_PARTITION, "tensor x pipeline parallelism: split by stage"
    )


def _sequence_layout_keys(sp: int, ds: ResolvedDSConfig, config_path: str) -> tuple[DSKey, ...]:
    in_json = ds.config.get("sequence_parallel_size")
    if in_json not in (None, 1, "auto", sp):
        raise UsageError(
            f"sequence_parallel_size {in_json} in {config_path} contradicts --sequence_parallel_size {sp}",
            "remove the key and pass --sequence_parallel_size",
        )
    if sp == 1:
        return ()
    if ds.zero_stage == 0:
        raise UsageError(
            f"--sequence_parallel_size {sp} with ZeRO stage 0 ({config_path}): not supported here "
            "(verified with ZeRO-1, 2 and 3)",
            "use a ZeRO-1, 2 or 3 config",
        )
    zero = ds.config.get("zero_optimization", {})
    nvme = [key for key in ("offload_optimizer", "offload_param") if (zero.get(key) or {}).get("device") == "nvme"]
    if nvme:
        raise UsageError(
            f"--sequence_parallel_size {sp} with zero_optimization.{nvme[0]} on NVMe ({config_path}): not "
            "supported here (verified with CPU offload)",
            "use ds_configs/zero3_offload.json (CPU offload) with sequence parallelism",
        )
    return (DSKey("sequence_parallel_size", sp, "--sequence_parallel_size"),)


def _check_pipeline_config(pp: int, ds: ResolvedDSConfig, config_path: str) -> None:
    in_json = (ds.config.get("pipeline") or {}).get("stages") if isinstance(ds.config.get("pipeline"), dict) else None
    if in_json not in (None, "auto", pp):
        raise UsageError(
            f"pipeline.stages {in_json} in {config_path} contradicts --pipeline_parallel_size {pp}",
            "remove the key and pass --pipeline_parallel_size",
        )
    if pp == 1:
        return
    if ds.zero_stage >= 2:
        raise UsageError(
            f"--pipeline_parallel_size {pp} with ZeRO stage {ds.zero_stage} ({config_path}): DeepSpeed's "
            "pipeline engine supports ZeRO-0 and ZeRO-1 only (gradients are reduced per stage at the "
            "end of the schedule, which ZeRO-2's and ZeRO-3's partitioned gradients do not allow)",
            "use ds_configs/zero1.json with pipeline parallelism",
        )
    if ds.offloads_optimizer or ds.offloads_params:
        raise UsageError(
            f"--pipeline_parallel_size {pp} with offload ({config_path}): not supported here (untested)",
            "use ds_configs/zero1.json with pipeline parallelism",
        )


def check_pipeline_run(
    layout: ParallelLayout,
    *,
    attention_isolation: bool,
    precision: str,
    zero_stage: int,
    config_path: str,
    micro_batches: int | None = None,
) -> str | None:
    """What the pipeline path does not carry yet, refused before anything is built; and the warning for a schedule
    that runs but cannot fill the pipeline (fewer micro-batches a step than stages), or None."""
    pp = layout.pp
    if pp == 1:
        return None
    if attention_isolation:
        raise UsageError(
            f"--pipeline_parallel_size {pp} with --attention_isolation: not supported yet (the "
            "per-document mask would have to be rebuilt inside every stage)",
            "drop --attention_isolation, or train without pipeline parallelism",
        )
    if zero_stage == 0 and precision != "fp32":
        raise UsageError(
            f"--pipeline_parallel_size {pp} with ZeRO stage 0 in {precision} ({config_path}): the "
            "gradient-clipping fix for stage 0 covers fp32 only",
            "use ds_configs/zero1.json with pipeline parallelism",
        )
    if micro_batches is not None and micro_batches < pp:  # valid, only slow: DeepSpeed's schedule runs it
        shrink = 4 * pp
        return (
            f"--pipeline_parallel_size {pp} with {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} a "
            f"step (--gradient_accumulation_steps {micro_batches}): fewer micro-batches than stages leave a stage "
            f"idle at every moment, a predicted bubble of {(pp - 1) / micro_batches:.0%} of the step's work "
            f"((stages - 1) / micro-batches, as the time model counts it); --gradient_accumulation_steps {shrink} "
            f"brings it to {(pp - 1) / shrink:.0%}, with a smaller --per_device_train_batch_size for the same global "
            "batch"
        )
    return None


def check_pipeline_layout(
    layout: ParallelLayout,
    *,
    model_config,
    attn_implementation: str,
    block_size: int,
    isolates_documents: bool,
    ds: ResolvedDSConfig,
    config_path: str,
) -> str | None:
    """Pipeline parallelism: the model maps onto its stages, and the run asks nothing the pipeline path lacks; the
    warning for a schedule that cannot fill the pipeline, or None."""
    pp, tp = layout.pp, layout.tp
    check_pipeline_model(
        pp, model_config=model_config, attn_implementation=attn_implementation, block_size=block_size, tp=tp
    )
    micro_batches = ds.config.get("gradient_accumulation_steps")
    return check_pipeline_run(
        layout,
        attention_isolation=isolates_documents,
        precision=ds.precision,
        zero_stage=ds.zero_stage,
        config_path=config_path,
        micro_batches=micro_batches,
    )
