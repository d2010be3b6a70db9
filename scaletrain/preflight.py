"""Everything decided before heavy work: flags, the resolved DeepSpeed config, model config and tokenizer.

Nothing here builds a process group, a model or a dataset, and nothing is written: a mistake found here ends
the run with exit code 2 and leaves the output folder as it was.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from scaletrain.checkpoint import (
    check_push_target,
    check_resumable,
    offload_setting,
    read_train_state,
    resolve_resume,
    saved_zero_stage,
)
from scaletrain.config import (
    check_preference_run,
    explain_run_config,
    HardwareFacts,
    load_ds_config,
    parse_run_config,
    resolve_ds_config,
    ResolvedDSConfig,
    RunConfig,
)
from scaletrain.errors import UsageError
from scaletrain.data import check_block_size, check_data_source
from scaletrain.distributed import (
    check_model_layout,
    check_pipeline_layout,
    check_sequence_layout,
    describe_layout,
    DistInfo,
    place_ranks,
    rank_hosts,
    resolve_layout,
)
from scaletrain.engine import check_compile, check_deepspeed_hooks, compile_requested
from scaletrain.train import check_reference_model
from scaletrain.observability import load_eval_prompts, METRICS_FILE, model_flops, ModelFlops, ModelShape, read_records
from scaletrain.model import (
    check_model_features,
    check_tokenizer_fits,
    describe_model,
    load_model_config,
    load_tokenizer,
    max_positions,
)

log = logging.getLogger(__name__)
RUN_CONFIG_FILE = "run_config.json"
DS_CONFIG_FILE = "ds_config.json"
EXPLAINED_FILE = "config_sources.txt"  # the same text --print_config prints


@dataclass(frozen=True)
class ResolvedRun:
    """What the pre-flight decided: the flags, the resolved DeepSpeed JSON, the model's config and tokenizer, the
    block size and the checkpoint to resume; handed to every later phase of the run."""

    cfg: RunConfig
    ds: ResolvedDSConfig
    dist: DistInfo  # the launch's ranks with this run's parallel layout (data-parallel size and rank)
    model_config: Any
    tokenizer: Any
    block_size: int
    n_params: int
    resume_from: Path | None = None  # the committed checkpoint this run continues, if any
    model_facts: dict | None = None  # what a checkpoint must match to be resumed by this model
    resume_state: dict | None = None  # the checkpoint's train state (step, data position)
    flops: ModelFlops | None = None  # FLOPs per token of this model at this block size
    reshard: bool = False  # the checkpoint loads through a universal one (other ranks, layout or offload)
    model_shape: Any = None  # --plan: the memory planner's view of the model (memory_planner.ModelShape)
    previous_run_config: dict | None = None  # run_config.json of the run being resumed, where there is one
    router_loss: Any = None  # a mixture-of-experts model's load-balancing loss (model/moe.py RouterLoss) or None
    eval_prompts: Any = None  # --eval_prompts read and tokenized (observability/eval_prompts.py) or None
    chat: Any = None  # chat data (data/chat_store.py ChatData): its template and loss mode, or None for text
    attn_implementation: str | None = None  # the attention backend: --attn_implementation, or transformers' choice


def hardware_facts() -> HardwareFacts:
    import torch
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return HardwareFacts(accelerator=name, bf16_fast=name == "cuda" and torch.cuda.is_bf16_supported())


def _hidden_size(model_config) -> int:
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UsageError(f"{type(model_config).__name__}: cannot find the model's hidden size")


def checkpoint_bytes(n_params: int, precision: str, trainable: int | None = None, merged: bool = False) -> tuple:
    """(bytes of one checkpoint plus the HF export, the arithmetic in words) for AdamW under DeepSpeed. With LoRA
    (`trainable` adapter parameters of n_params) the checkpoint and the export hold the adapter only, plus the
    merged model with --merge_lora."""
    # fp32 weights (the master copy under bf16/fp16) + Adam's two fp32 moments, plus 16-bit module weights
    # under bf16/fp16; the Hugging Face export adds the weights once more in the training dtype.
    weight = 4 if precision == "fp32" else 2
    per_param = 12 + (2 if precision != "fp32" else 0) + weight
    if trainable is None:
        return n_params * per_param, f"{n_params / 1e9:.2f}B parameters x {per_param} bytes"
    extra = n_params * weight if merged else 0
    return trainable * per_param + extra, (
        f"an adapter of {trainable / 1e6:.1f}M parameters x {per_param} bytes"
        + (f", the merged {n_params / 1e9:.2f}B x {weight}" if merged else "")
    )


def _check_disk_space(
    output_dir: str, n_params: int, precision: str, trainable: int | None = None, merged: bool = False
) -> None:
    folder = Path(output_dir).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    needed, how = checkpoint_bytes(n_params, precision, trainable, merged)
    if free < needed:
        raise UsageError(
            f"--output_dir {output_dir}: {free / 1e9:.1f} GB free on its disk, one checkpoint and the export "
            f"need about {needed / 1e9:.1f} GB ({how})",
            "free space or point --output_dir at a larger disk",
        )


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        log.warning("%s: unreadable (%s); a changed LR schedule cannot be checked on this resume", path, err)
        return None


def read_previous_run_config(resume_from: Path) -> dict | None:
    """run_config.json of the run that wrote the checkpoint (its run folder, <run>/checkpoints/stepN), read before
    this run rewrites it, with "peak_lr": the LR its optimizer got (ds_config.json's optimizer.params.lr, which an
    explicit JSON value sets instead of --learning_rate). None for a checkpoint copied out of its run folder."""
    folder = resume_from.resolve().parent.parent
    run_config = _read_json(folder / RUN_CONFIG_FILE)
    if run_config is None:
        return None
    lr = ((_read_json(folder / DS_CONFIG_FILE) or {}).get("optimizer") or {}).get("params", {}).get("lr")
    peak = lr if isinstance(lr, (int, float)) else run_config.get("learning_rate")
    return {**run_config, "peak_lr": peak}


def peak_lr(ds: ResolvedDSConfig) -> float:
    """The peak LR the optimizer gets: --learning_rate, or an explicit optimizer.params.lr of the JSON."""
    return float(ds.config["optimizer"]["params"]["lr"])


def _check_peak_lr(cfg: RunConfig, ds: ResolvedDSConfig, previous: dict | None, resume_from: Path) -> None:
    """A resumed run restarts its schedule from its own peak LR; another peak than the run it continues is refused
    unless asked for."""
    old, new = (previous or {}).get("peak_lr"), peak_lr(ds)
    if old is None or old == new or cfg.checkpoint.allow_schedule_change:
        return
    flag = (
        "--learning_rate"
        if ds.sources.get("optimizer.params.lr") == "--learning_rate"
        else f"optimizer.params.lr in {cfg.engine.config}"
    )
    raise UsageError(
        f"{flag} {new}: the run resumed from {resume_from} trained with a peak LR of {old}",
        f"use {flag} {old} to continue it, or add --allow_schedule_change to resume with the new peak",
    )


def check_rampup(rampup: tuple | None, ds: ResolvedDSConfig, dp_world_size: int) -> None:
    """--rampup_batch_size fits the run's batch: every stage is whole micro-batches on every data-parallel rank, and
    the ramp ends exactly at the full global batch."""
    if rampup is None:
        return
    start, increment, samples = rampup
    micro, full = ds.config["train_micro_batch_size_per_gpu"], ds.config["train_batch_size"]
    unit = micro * dp_world_size
    flag = f"--rampup_batch_size {start} {increment} {samples}"
    if start >= full:
        raise UsageError(
            f"{flag}: START {start} is not below the global batch {full} (micro batch {micro} x "
            f"accumulation {full // unit} x data-parallel size {dp_world_size})",
            "start smaller, or drop the flag",
        )
    for name, value in (("START", start), ("INCREMENT", increment)):
        if value % unit:
            raise UsageError(
                f"{flag}: {name} {value} is not a multiple of micro batch {micro} x data-parallel "
                f"size {dp_world_size} = {unit}",
                f"use a multiple of {unit}",
            )
    if (full - start) % increment:
        raise UsageError(
            f"{flag}: INCREMENT {increment} does not divide the ramp from {start} to the global batch {full}",
            f"choose an INCREMENT that divides {full - start}",
        )
    if samples < (full - start) // increment:
        raise UsageError(
            f"{flag}: SAMPLES {samples} is fewer than the ramp's {(full - start) // increment} stages",
            "ramp over more samples",
        )


def _resolve_resume_point(cfg: RunConfig, ds: ResolvedDSConfig, model_facts: dict, dist: DistInfo) -> tuple:
    """(checkpoint to resume or None, its train state, whether it comes from another data-parallel size, the
    previous run's run_config.json or None)."""
    if cfg.planning.plan:
        return None, None, False, None
    resume_from = resolve_resume(cfg.checkpoint.resume_from_checkpoint, cfg.run.output_dir)
    if resume_from is None:
        return None, None, False, None
    return _resume_point(cfg, ds, model_facts, dist, resume_from)


def resume_elsewhere(resolved: ResolvedRun, ckpt: Path) -> ResolvedRun:
    """The run resolved to resume `ckpt` instead (the fallback from a damaged checkpoint): its train state,
    whether it is resharded, the previous run's config, each checked as the pre-flight checks its choice."""
    resolved.ds.config.get("checkpoint", {}).pop("load_universal", None)  # set again if `ckpt` needs it
    resolved.ds.sources.pop("checkpoint.load_universal", None)
    resume_from, resume_state, reshard, previous = _resume_point(
        resolved.cfg, resolved.ds, resolved.model_facts, resolved.dist, ckpt
    )
    return dataclasses.replace(
        resolved, resume_from=resume_from, resume_state=resume_state, reshard=reshard, previous_run_config=previous
    )


def _resume_point(cfg: RunConfig, ds: ResolvedDSConfig, model_facts: dict, dist: DistInfo, resume_from: Path) -> tuple:
    previous = read_previous_run_config(resume_from)
    _check_peak_lr(cfg, ds, previous, resume_from)
    metrics_file = Path(cfg.run.output_dir) / METRICS_FILE
    if metrics_file.exists():
        read_records(metrics_file)  # damaged before its end: refused here, on every rank, before anything is built
    layout = (dist.tensor_parallel_size, dist.sequence_parallel_size)
    reshard = check_resumable(
        resume_from,
        dist.dp_world_size,
        layout,
        ds.zero_stage,
        model_facts,
        dist.pipeline_parallel_size,
        offload_setting(ds),
    )
    resume_state = read_train_state(resume_from)
    if reshard:
        ds.config.setdefault("checkpoint", {})["load_universal"] = True
        saved_layout = tuple(
            resume_state.get(f"{kind}_parallel_size", 1) for kind in ("tensor", "sequence", "pipeline")
        )
        ds.sources["checkpoint.load_universal"] = (
            f"resume of a checkpoint from {resume_state['world_size']} data-parallel ranks x (tensor, sequence, "
            f"pipeline) parallel {saved_layout} on {dist.dp_world_size} x ({dist.tensor_parallel_size}, "
            f"{dist.sequence_parallel_size}, {dist.pipeline_parallel_size}), ZeRO stage "
            f"{saved_zero_stage(resume_from, resume_state)} ({resume_state.get('offload') or 'offload unrecorded'}) "
            f"on {ds.zero_stage} ({offload_setting(ds)})"
        )
    return resume_from, resume_state, reshard, previous


def resolve_run(argv: Sequence[str] | None, dist: DistInfo) -> ResolvedRun:
    """Every check before heavy work, one line per concern in the order problems are reported (UsageError, exit 2).
    Each wing checks its own flags; what one check finds is handed on to those after it that need it."""
    cfg = parse_run_config(argv)
    dist = place_ranks(cfg.parallel, cfg.planning, dist)
    check_deepspeed_hooks()  # a DeepSpeed internal that moved: one line now, not a crash in the first step
    raw_ds_config = load_ds_config(cfg.engine.config)
    model_config = load_model_config(cfg.model)
    check_model_layout(cfg.parallel, model_config)
    tokenizer = load_tokenizer(cfg.model)
    chat = check_data_source(cfg.data, tokenizer, reads_first_row=dist.rank == 0)  # one hub request, not one a rank
    check_push_target(cfg.checkpoint.push_to_hub, cfg.checkpoint.export_hf_at_end)
    check_tokenizer_fits(cfg.model, model_config, tokenizer)
    block_size = check_block_size(cfg.data, cfg.model.tokenizer_source, tokenizer, max_positions(model_config))
    skeleton, model_facts = describe_model(cfg, model_config)
    hardware = hardware_facts()
    ds = _resolve_engine_config(cfg, raw_ds_config, dist, model_config, hardware, skeleton)
    # packed sequences kept apart by restarting position ids: SFT chat examples, and padding-free preference pairs
    isolates_documents = cfg.data.attention_isolation or (
        chat is not None and (chat.kind != "preference" or cfg.data.padding_free)
    )
    router_loss = check_model_features(cfg, ds, skeleton, model_config, hardware, isolates_documents)
    check_preference_run(cfg, chat is not None and chat.kind == "preference", router_loss is not None)
    check_reference_model(cfg, model_config)
    attn = skeleton.config._attn_implementation
    layout = (dist.tensor_parallel_size, dist.sequence_parallel_size, dist.pipeline_parallel_size)
    check_sequence_layout(cfg.parallel, block_size, attn, hardware.accelerator)
    check_compile(compile_requested(cfg.engine.torch_compile, ds.config), layout, cfg.engine.config)
    if not cfg.planning.plan:  # --plan covers every layout option, whatever this launch is
        check_pipeline_layout(cfg.parallel, model_config, attn, block_size, isolates_documents, ds, cfg.engine.config)
    logging_args = cfg.logging
    eval_prompts = load_eval_prompts(
        logging_args.eval_prompts, tokenizer, logging_args.eval_max_new_tokens, max_positions(model_config), layout
    )
    resume_from, resume_state, reshard, previous = _resolve_resume_point(cfg, ds, model_facts, dist)
    trained = _trained_model(cfg, skeleton, model_config)
    _check_disk_space_for(cfg, ds, model_facts["n_params"], trained)
    return ResolvedRun(
        cfg,
        ds,
        dist,
        model_config,
        tokenizer,
        block_size,
        model_facts["n_params"],
        resume_from=resume_from,
        model_facts=model_facts,
        resume_state=resume_state,
        reshard=reshard,
        flops=model_flops(trained, model_config, block_size),
        model_shape=_planned_model_shape(cfg, skeleton, model_config),
        previous_run_config=previous,
        router_loss=router_loss,
        eval_prompts=eval_prompts,
        chat=chat,
        attn_implementation=attn,
    )


def _resolve_engine_config(
    cfg: RunConfig, raw_ds_config: dict, dist: DistInfo, model_config, hardware: HardwareFacts, skeleton
) -> ResolvedDSConfig:
    """The DeepSpeed JSON with every "auto" filled, and the engine-side checks that need it: the parallel layout's
    DeepSpeed keys, the batch ramp-up, and whether a non-finite update can be skipped."""
    pp = dist.pipeline_parallel_size
    shape = ModelShape.from_meta_model(skeleton, model_config)
    ds = resolve_ds_config(
        raw_ds_config,
        cfg.engine,
        cfg.optim,
        cfg.explicit_flags,
        dist.dp_world_size,
        _hidden_size(model_config),
        hardware,
        shape.n_params,
        int(shape.params_per_rank(1, pp)) if pp > 1 else None,
    )
    if not cfg.planning.plan:  # --plan covers every ZeRO option for the layout, whatever --config says
        resolve_layout(cfg.parallel, ds, cfg.engine.config)
    check_rampup(cfg.optim.rampup_batch_size, ds, dist.dp_world_size)
    if cfg.nonfinite.on_nonfinite == "skip" and ds.zero_stage == 0 and ds.precision != "fp32":
        raise UsageError(
            f"--on_nonfinite skip: updates of ZeRO stage 0 in {ds.precision} cannot be skipped",
            "use a ZeRO stage 1-3 config, or --on_nonfinite stop",
        )
    return ds


def _check_disk_space_for(cfg: RunConfig, ds: ResolvedDSConfig, n_params: int, trained) -> None:
    """A run that will save: room for one checkpoint and the export (--print_config and --plan save nothing)."""
    if cfg.run.print_config or cfg.planning.plan:
        return
    adapter = sum(p.numel() for p in trained.parameters() if p.requires_grad) if cfg.peft.use_peft else None
    _check_disk_space(cfg.run.output_dir, n_params, ds.precision, adapter, cfg.peft.merge_lora)


def _planned_model_shape(cfg: RunConfig, skeleton, model_config):
    """--plan: the memory planner's view of the model (observability.ModelShape); None otherwise."""
    if not cfg.planning.plan:
        return None
    from scaletrain.observability import ModelShape

    return ModelShape.from_meta_model(skeleton, model_config)


def _trained_model(cfg: RunConfig, skeleton, model_config):
    """The meta model as it trains: with --use_peft, the base frozen and the adapter added (FLOPs, disk space)."""
    if not cfg.peft.use_peft:
        return skeleton
    from scaletrain.model import meta_lora_model

    return meta_lora_model(model_config, cfg.peft, cfg.model.model_name_or_path, cfg.model.trust_remote_code)


def explain_resolved_run(resolved: ResolvedRun, dp_world_size: int) -> str:
    """The resolved run and DeepSpeed configs with the source of every value."""
    return "\n".join(
        [
            f"run config (block_size = {resolved.block_size}, model {resolved.n_params / 1e6:.2f}M parameters):",
            explain_run_config(resolved.cfg),
            f"DeepSpeed config {resolved.cfg.engine.config}, resolved for {dp_world_size} data-parallel rank(s); "
            f"precision {resolved.ds.precision} ({resolved.ds.precision_reason}):",
            resolved.ds.explained(),
        ]
    )


def print_config(resolved: ResolvedRun, dist: DistInfo) -> None:
    """--print_config: everything resolved, printed by rank 0; nothing is built or written."""
    if dist.is_main:
        print(explain_resolved_run(resolved, dist.dp_world_size))


def _ranges(ranks: list) -> str:
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1
        else ",".join(map(str, ranks))
    )


def describe_launch(resolved: ResolvedRun, dist: DistInfo) -> None:
    hosts = rank_hosts()
    placement = ", ".join(
        f"{host} (ranks {_ranges([r for r, h in enumerate(hosts) if h == host])})" for host in dict.fromkeys(hosts)
    )
    log.info(
        "launch: %s, world size %d on %d host(s): %s; layout: %s",
        dist.launcher,
        dist.world_size,
        len(set(hosts)),
        placement,
        describe_layout(dist),
    )
    log.info("precision: %s (%s)", resolved.ds.precision, resolved.ds.precision_reason)
    named = resolved.cfg.model.attn_implementation is not None
    log.info(
        "attention: %s (%s)",
        resolved.attn_implementation,
        "--attn_implementation" if named else f"transformers' choice for {resolved.model_config.model_type}",
    )
    log.info("resolved DeepSpeed config (%s):\n%s", resolved.cfg.engine.config, resolved.ds.explained())


def write_run_folder(resolved: ResolvedRun, extra: dict, dist: DistInfo) -> None:
    """Save the resolved configs beside the run's outputs, so the run can be read back and repeated."""
    if not dist.is_main:
        return
    out = Path(resolved.cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_config = {**resolved.cfg.to_dict(), "block_size": resolved.block_size, **extra}
    (out / RUN_CONFIG_FILE).write_text(json.dumps(run_config, indent=2) + "\n")
    (out / DS_CONFIG_FILE).write_text(json.dumps(resolved.ds.config, indent=2) + "\n")
    (out / EXPLAINED_FILE).write_text(explain_resolved_run(resolved, dist.dp_world_size) + "\n")


def print_memory_plan(resolved: ResolvedRun) -> None:
    """--plan: the memory table for each ZeRO stage and offload option, and the recommended config."""
    from scaletrain.observability import (
        MemoryFeatures,
        auto_loss_chunk,
        plan_memory,
        render_longest_blocks,
        render_memory_plan,
    )

    planning, optim, engine = resolved.cfg.planning, resolved.cfg.optim, resolved.cfg.engine
    shape = resolved.model_shape  # from the meta model resolve_run built
    precision = "bf16" if engine.bf16 else "fp16" if engine.fp16 else planning.plan_precision
    parallel = resolved.cfg.parallel
    tp, sp, pp = parallel.tensor_parallel_size, parallel.sequence_parallel_size, parallel.pipeline_parallel_size
    chunk = resolved.cfg.model.loss_chunk_size
    loss_chunk = None if chunk == 0 else chunk or auto_loss_chunk(shape.vocab)
    features = MemoryFeatures(resolved.cfg.model.tiled_mlp, resolved.cfg.model.activation_offloading)
    longest_blocks = None
    if tp == 1 and pp == 1 and shape.heads:  # the longest block with each long-context feature
        host = planning.host_memory_gb and planning.host_memory_gb * 2**30
        gpu = planning.gpu_memory_gb * 2**30
        longest_blocks = render_longest_blocks(
            shape, planning.num_gpus, planning.num_nodes, precision, gpu, host, loss_chunk
        )
    estimates = plan_memory(
        shape,
        planning.num_gpus,
        planning.num_nodes,
        optim.per_device_train_batch_size,
        resolved.block_size,
        precision,
        tp,
        sp,
        pp,
        loss_chunk,
        features,
    )
    print(
        render_memory_plan(
            estimates,
            shape,
            planning.num_gpus,
            planning.num_nodes,
            planning.gpu_memory_gb,
            planning.host_memory_gb,
            optim.per_device_train_batch_size,
            resolved.block_size,
            precision,
            tp,
            sp,
            pp,
            loss_chunk,
            longest_blocks,
            features,
        )
    )
    if resolved.cfg.checkpoint.async_save:  # the host memory asynchronous saves take beside the plan above
        from scaletrain.checkpoint import snapshot_bytes_per_rank

        world = planning.num_gpus * planning.num_nodes
        per_rank = {zero: snapshot_bytes_per_rank(shape.n_params, precision, zero, world) / 2**30 for zero in (1, 3)}
        print(
            f"--async_save: snapshot buffers in host memory (/dev/shm), per rank: up to {per_rank[1]:.2f} GiB under "
            f"ZeRO-0/1/2 (rank 0 also copies the module's weights), {per_rank[3]:.2f} GiB under ZeRO-3; x "
            f"{planning.num_gpus} ranks per node (--no-async_save needs none)"
        )
