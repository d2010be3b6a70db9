"""How each part of a run is built from the pre-flight's plan: the process group, the inputs, this rank's model, the
engine and its step runner, the sinks, the reference log-probs, the hang watch, the live benchmark scores; and the
`Lifetime` that releases what they acquire. scaletrain/run.py's build_run calls them in order."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.checkpoint import (
    CheckpointManager,
    CheckpointSettings,
    clear_previous_run,
    SaveSchedule,
    verify_resume,
    write_run_folder,
)
from scaletrain.data import prepare_stores
from scaletrain.distributed import (
    barrier,
    build_pipeline_module,
    communication_threads,
    check_tensor_groups_within_nodes,
    describe_launch,
    init_distributed,
    preflight_facts,
    register_ulysses,
    settle,
    store_facts,
    teardown_distributed,
    use_shm_allreduce,
)
from scaletrain.engine import (
    build_engine,
    compile_engine,
    compile_requested,
    release_engine,
    restart_schedule,
    repair_universal_load,
    SkipSwitch,
)
from scaletrain.errors import HANG_EXIT_CODE, RunEnded
from scaletrain.harness import LiveScores
from scaletrain.logs import interactive
from scaletrain.model import (
    apply_lora,
    build_model,
    build_qlora_model,
    install_chunked_loss,
    mark_leaf_modules,
)
from scaletrain.observability import (
    CommLog,
    GoodputLedger,
    HostMemoryPhase,
    MetricsLogger,
    RunIdentity,
)
from scaletrain.data import TrainingData
from scaletrain.plan import RunPlan
from scaletrain.train import (
    EngineStep,
    enable_flight_recorder,
    NonFiniteGuard,
    NonFinitePolicy,
    PipelineStep,
    prepare_reference,
    reference_identity,
    seed_everything,
    start_hang_watch,
    TrainState,
)

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers.integrations import HfDeepSpeedConfig

    from scaletrain.distributed import TokenLoss

    from scaletrain.engine import LRSchedule
    from scaletrain.train import HangWatch, PreferenceObjective

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltModel:
    """The model as this rank holds it, before deepspeed.initialize."""

    module: torch.nn.Module  # under pipeline parallelism, deepspeed's PipelineModule of this rank's stage
    keepalive: HfDeepSpeedConfig | None = None  # ZeRO-3: alive while transformers builds the model sharded
    pipeline_loss: TokenLoss | None = None  # pipeline parallelism: the pipe engine's loss_fn


class Lifetime:
    """What a run acquires, released in reverse by close() on the error path too: the run's parts first, the
    process group last; and how the run ended (the process's exit code), for the sinks that record it."""

    def __init__(self) -> None:
        self.exit_code = 1  # a crash, unless told otherwise
        self.parts = ExitStack()  # engines, sinks, signal handlers, watches: released before the process group
        self.world = ExitStack()  # the process group and its check: released last

    def close(self, exit_code: int) -> None:
        self.exit_code = exit_code
        try:
            self.parts.close()
        finally:
            self.world.close()


def start_world(resolved: RunPlan, *, lifetime: Lifetime) -> None:
    """The process group of the plan's launch, then every rank's pre-flight verdict: a rank whose pre-flight failed
    joins too (distributed.stop_with_the_others), so its mistake stops every rank here; the ranks also compare the
    resume checkpoint, tokenizer and run configuration each found, before any rank acts on them."""
    cfg, dist = resolved.cfg, resolved.dist
    enable_flight_recorder(cfg.run.output_dir)  # on a GPU: NCCL's trace, for a hang's report
    started = init_distributed(dist, cfg.hang.ddp_timeout)
    lifetime.world.callback(check_teardown)
    lifetime.world.callback(teardown_distributed, dist.rank)
    assert started == dist, f"the pre-flight planned {dist}, the process group started {started}"
    facts = preflight_facts(
        run_configuration=cfg.to_dict(),
        block_size=resolved.block_size,
        ds_config=resolved.ds.config,
        tokenizer=resolved.tokenizer,
        resume=resolved.resume,
    )
    settle(dist, facts=facts)
    # the run's first lines: where the ranks landed, what each runs with
    hosts = describe_launch(dist, ds=resolved.ds, config_path=cfg.engine.config, attention=attention_choice(resolved))
    check_tensor_groups_within_nodes(dist.layout, hosts, allow_cross_node=cfg.parallel.allow_cross_node_tensor_parallel)
    if cfg.engine.cpu_shm_allreduce:  # after the rendezvous: every rank decides on the same facts
        shm = use_shm_allreduce(dist)
        if shm is not None:
            lifetime.parts.callback(release_shm_allreduce, shm)
    seed_everything(cfg.optim.seed)


def attention_choice(resolved: RunPlan) -> str:
    """The model's attention backend and who chose it, as the launch line says it."""
    named = resolved.cfg.model.attn_implementation is not None
    chooser = "--attn_implementation" if named else f"transformers' choice for {resolved.model_config.model_type}"
    return f"{resolved.attn_implementation} ({chooser})"


def prepare_inputs(resolved: RunPlan) -> tuple[RunPlan, tuple]:
    """The resume checkpoint verified and converted, and the token stores, then the ranks settle: a failure on any
    rank (a node whose store could not be prepared) stops every rank, and so do token stores that differ between
    ranks. The plan comes back with the checkpoint the run continues."""
    error = None
    stores: tuple = ()
    try:
        resolved = prepare_resume(resolved)
        stores = prepare_stores(
            resolved.cfg,
            dist=resolved.dist,
            tokenizer=resolved.tokenizer,
            block_size=resolved.block_size,
            chat=resolved.chat,
        )
    except RunEnded as err:
        error = err
    settle(resolved.dist, error, None if error else store_facts(list(stores)))
    return resolved, stores


def prepare_resume(resolved: RunPlan) -> RunPlan:
    """The plan with the checkpoint the ranks verified (checkpoint.verify_resume: a damaged one falls back to the one
    before it, with the DeepSpeed config that loads it)."""
    resume, ds = verify_resume(
        resolved.resume, cfg=resolved.cfg, ds=resolved.ds, model_facts=resolved.model_facts, dist=resolved.dist
    )
    return resolved if resume is resolved.resume else resolved.replace(resume=resume, ds=ds)


def build_rank_model(resolved: RunPlan, *, lifetime: Lifetime) -> BuiltModel:
    """This rank's model (ZeRO-3: built sharded; pipeline: its stage alone), with LoRA and the layout's attention
    and stage wrappers."""
    memory = HostMemoryPhase("model build")
    cfg, layout = resolved.cfg, resolved.dist.layout
    # The backend the pre-flight's meta model was built with: the one named, or the one transformers chose.
    args = dataclasses.replace(cfg.model, attn_implementation=resolved.attn_implementation)
    if cfg.peft.load_in_4bit:  # QLoRA: the base in 4 bits on this rank's GPU, then LoRA as below
        module, keepalive = build_qlora_model(args, resolved.model_config, resolved.ds)
    else:
        pipeline = layout.pp > 1 and not cfg.peft.use_peft  # stages built alone
        module, keepalive = build_model(args, resolved.model_config, resolved.ds.config, pipeline)
    if cfg.peft.use_peft:  # LoRA: peft wraps the built (ZeRO-3: partitioned) model; only the adapter trains
        module = apply_lora(module, cfg.peft)
    if resolved.ds.zero_stage == 3:  # before deepspeed.initialize, which installs the gather hooks
        mark_leaf_modules(module, resolved.model_config)
    if layout.sp > 1:
        undo = register_ulysses(
            module,
            dist=resolved.dist,
            model_config=resolved.model_config,
            block_size=resolved.block_size,
            micro_batch=resolved.ds.micro_batch,
            attention_isolation=cfg.data.attention_isolation or resolved.chat is not None,
        )
        lifetime.parts.callback(undo)
    pipeline_loss = None
    if layout.pp > 1:  # this rank keeps its stage's layers of the model it built
        module, pipeline_loss = build_pipeline_module(
            module, layout, cfg.parallel.pipeline_partition, cfg.model.loss_chunk_size
        )
    memory.report()
    return BuiltModel(module, keepalive, pipeline_loss)


def write_outputs_folder(resolved: RunPlan, data: TrainingData) -> None:
    """The resolved configs saved beside the outputs, only after everything before succeeded."""
    cfg = resolved.cfg
    if cfg.run.dry_run:
        return  # a dry run leaves the output folder as it was
    if resolved.resume is None and cfg.run.overwrite_output_dir and resolved.dist.is_main:
        clear_previous_run(cfg.run.output_dir)  # an explicit fresh start in a used folder
    schedule = data.schedule
    write_run_folder(
        cfg,
        ds=resolved.ds,
        dist=resolved.dist,
        block_size=resolved.block_size,
        n_params=resolved.n_params,
        schedule_facts={"total_steps": schedule.total_steps, "warmup_steps": schedule.warmup_steps},
        model_config=resolved.model_config,
    )
    barrier()  # the folder exists before any rank writes into it


def build_engine_and_runner(
    resolved: RunPlan, *, model: BuiltModel, data: TrainingData, lifetime: Lifetime
) -> tuple[DeepSpeedEngine, EngineStep | PipelineStep]:
    """deepspeed.initialize with the resolved config and LR schedule, and the step runner that drives it."""
    cfg, ds = resolved.cfg, resolved.ds
    engine = build_engine(
        model.module,
        ds_config=ds.config,
        weight_decay=cfg.optim.weight_decay,
        schedule=data.schedule,
        layout=resolved.dist.layout,
    )
    lifetime.parts.callback(release_engine_quietly, engine)
    switch = SkipSwitch(engine.optimizer) if cfg.nonfinite.on_nonfinite == "skip" else None
    runner: EngineStep | PipelineStep
    if model.pipeline_loss is not None:
        runner = PipelineStep(engine, model.pipeline_loss, switch)
    else:  # after deepspeed.initialize (tensor parallelism may replace the head), before compile
        runner = EngineStep(switch)
        install_chunked_loss(engine.module, cfg.model.loss_chunk_size)
    if compile_requested(cfg.engine.torch_compile, ds.config):
        compile_engine(engine, cfg.engine.torch_compile_backend, cfg.engine.torch_compile_mode)
    return engine, runner


def open_comm_log(resolved: RunPlan, *, lifetime: Lifetime) -> CommLog | None:
    """--comms_log: each collective's count, bytes and bandwidth, from here on (the engine's start-up broadcasts
    are not training's)."""
    if not resolved.cfg.logging.comms_log:
        return None
    comm_log = CommLog(resolved.dist.layout)
    lifetime.parts.callback(comm_log.close)
    return comm_log


def record_layout(state: TrainState, resolved: RunPlan) -> None:
    """The layout this run trains with, into the train state its checkpoints carry."""
    ds = resolved.ds
    state.record_layout(resolved.dist.layout, ds.zero_stage, ds.offload_setting)


def reloaded(
    engine: DeepSpeedEngine, *, state: TrainState, resolved: RunPlan, schedule: LRSchedule, universal: bool
) -> None:
    """After a checkpoint was loaded (resume, rollback): this run's flags rule from here on. A universal load
    restores no weight decay and (ZeRO-3) shares one Adam step counter: repaired here. The checkpoint restored the
    saving run's peak LR and next LR."""
    if universal:
        repair_universal_load(engine, resolved.cfg.optim.weight_decay)
    restart_schedule(engine.lr_scheduler, schedule, resolved.ds.peak_lr)
    record_layout(state, resolved)


def open_metrics(resolved: RunPlan, *, step: int, restored: dict, lifetime: Lifetime) -> MetricsLogger:
    """This attempt's metrics sinks (metrics.jsonl, wandb, tensorboard) from `step` on; wandb resumes the run id a
    resumed checkpoint carries (`restored`: the train state the load restored). Closed with the run's exit code (wandb
    marks a non-zero end failed)."""
    cfg = resolved.cfg
    out = cfg.run.output_dir
    identity = RunIdentity(cfg.run.run_name or Path(out).resolve().name, cfg.to_dict(), restored.get("wandb_run_id"))
    metrics = MetricsLogger(
        out,
        resolved.dist.is_main,
        cfg.logging.report_sinks,
        identity,
        resume_step=step,
        write_files=not cfg.run.dry_run,
    )
    lifetime.parts.callback(lambda: metrics.close(lifetime.exit_code))
    return metrics


def open_ledger(resolved: RunPlan) -> GoodputLedger:
    """This attempt's entry in the goodput ledger (begun by begin_ledger once the resume is loaded)."""
    cfg = resolved.cfg
    return GoodputLedger(cfg.run.output_dir, resolved.dist.is_main and not cfg.run.dry_run)


def begin_ledger(ledger: GoodputLedger, *, step: int, metrics: MetricsLogger, lifetime: Lifetime) -> None:
    """The attempt starts after `step`; it ends with the run's exit code, its figures in the metrics' summary."""
    ledger.begin(step)
    lifetime.parts.callback(lambda: ledger.end(lifetime.exit_code, metrics))


def open_checkpoints(
    resolved: RunPlan,
    *,
    engine: DeepSpeedEngine,
    state: TrainState,
    ledger: GoodputLedger,
    schedule: LRSchedule,
    lifetime: Lifetime,
) -> CheckpointManager:
    """The run's checkpoint manager (--async_save: with its background writer process); a dry run saves nothing
    periodically (it takes one step)."""
    cfg, ds = resolved.cfg, resolved.ds
    args, dry = cfg.checkpoint, cfg.run.dry_run
    when = SaveSchedule(
        save_steps=0 if dry else args.save_steps,
        interval_minutes=0.0 if dry else args.save_interval_minutes,
        at_end=args.save_at_end,
        preemption_grace_seconds=args.preemption_grace_seconds,
    )
    settings = CheckpointSettings(
        output_dir=cfg.run.output_dir,
        save_total_limit=args.save_total_limit,
        adapter_only=cfg.peft.use_peft,
        n_params=resolved.n_params,
        precision=ds.precision,
        zero_stage=ds.zero_stage,
        model_facts=resolved.model_facts,
        schedule=when,
        async_save=args.async_save and not dry,
        resume=resolved.resume,
    )
    manager = CheckpointManager(
        settings,
        engine=engine,
        state=state,
        ledger=ledger,
        dist=resolved.dist,
        reloaded=lambda universal: reloaded(
            engine, state=state, resolved=resolved, schedule=schedule, universal=universal
        ),
    )
    lifetime.parts.callback(manager.close)
    return manager


def nonfinite_guard(resolved: RunPlan, *, state: TrainState, checkpoints: CheckpointManager) -> NonFiniteGuard:
    """The non-finite guard; its running mean travels in the checkpoints, and its rollback is theirs."""
    cfg = resolved.cfg
    policy = NonFinitePolicy.from_args(cfg.nonfinite, fp16=resolved.ds.precision == "fp16")
    guard = NonFiniteGuard(
        policy,
        state,
        cfg.run.output_dir,
        resolved.dist.is_main,
        write_files=not cfg.run.dry_run,
        rollback=checkpoints.rollback,
    )
    checkpoints.carry(guard)
    return guard


def with_reference(
    objective: PreferenceObjective | None,
    resolved: RunPlan,
    *,
    engine: DeepSpeedEngine,
    data: TrainingData,
    state: TrainState,
    lifetime: Lifetime,
) -> PreferenceObjective | None:
    """Preference pairs: the objective with the reference's log-probs of every pair, read back or computed once
    before step 1. None for plain language modelling."""
    if objective is None:
        return None
    args = resolved.cfg.preference
    identity = None  # what precomputed log-probs depend on (reading the weights' identity: only where they are)
    if args.needs_reference and args.precompute_ref_log_probs:
        identity = reference_identity(
            resolved.cfg,
            precision=resolved.ds.precision,
            attn_implementation=resolved.attn_implementation,
            block_size=resolved.block_size,
        )
    reference = prepare_reference(
        engine, cfg=resolved.cfg, ds=resolved.ds, dist=resolved.dist, identity=identity, data=data, state=state
    )
    if reference is not None:  # a live reference's own engine
        lifetime.parts.callback(release_engine, reference)
    return dataclasses.replace(objective, reference=reference)


def watch_for_hangs(resolved: RunPlan, *, ledger: GoodputLedger, lifetime: Lifetime) -> HangWatch | None:
    """--hang_timeout: this rank's heartbeat, and a watch that ends a stuck run naming the ranks that stopped."""
    cfg = resolved.cfg
    if cfg.run.dry_run:
        return None
    on_hang = partial(ledger.end, HANG_EXIT_CODE)  # the attempt's end in goodput.json
    watch = start_hang_watch(cfg.hang, cfg.run.output_dir, resolved.dist, on_hang)
    if watch is not None:
        lifetime.parts.callback(watch.stop)
    return watch


def live_scores(
    resolved: RunPlan,
    *,
    engine: DeepSpeedEngine,
    metrics: MetricsLogger,
    watch: HangWatch | None,
    lifetime: Lifetime,
) -> LiveScores | None:
    """--lm_eval_tasks: lm-evaluation-harness on the live model, each data-parallel rank a share of the requests."""
    tasks, cfg, dist = resolved.lm_eval_tasks, resolved.cfg, resolved.dist
    if tasks is None:
        return None
    progress = (lambda what: watch.phase(f"lm-eval: {what}", long=True)) if watch is not None else None
    scores = LiveScores(
        engine.module,
        tokenizer=resolved.tokenizer,
        tasks=tasks,
        args=cfg.lm_eval,
        out_dir=Path(cfg.run.output_dir),
        data_rank=dist.coords.dp,
        data_ranks=dist.layout.dp,
        lockstep=resolved.ds.zero_stage == 3 and dist.layout.dp > 1,  # each forward a collective
        log=metrics.log,
        progress=progress,
        show_bars=dist.is_main and not cfg.logging.disable_tqdm and interactive(),
    )
    lifetime.parts.callback(scores.close)
    return scores


def release_engine_quietly(engine: DeepSpeedEngine) -> None:
    # The engine, optimizer and ZeRO-3 parameters hold process groups, so destroy_process_group alone left
    # gloo's threads running until the interpreter tore the objects down at exit, which now and then aborted
    # a finished run (SIGABRT, "terminate called without an active exception"). Free them here instead.
    try:
        release_engine(engine)
    except Exception as err:  # never hide the error that brought us here, nor skip the teardown
        log.warning("could not release the DeepSpeed engine cleanly: %s", err)


def release_shm_allreduce(shm) -> None:
    log.info("cpu: %d all-reduces (%.2f GB) went through shared memory", shm.calls, shm.bytes / 1e9)
    shm.uninstall()


def check_teardown() -> None:
    lingering = communication_threads()
    if lingering:
        log.warning(
            "%d communication threads outlive the process group: something still holds it, and the "
            "interpreter will tear it down at exit",
            lingering,
        )
