"""The composition root. `plan_run` is the pre-flight (every decision, before heavy work); `build_run` builds every
part of the run from that plan in one straight function, each part from the ones before it through the wing that
owns the concern, and returns the built `Run`; the trainer (train/trainer.py) then runs the loop with the run's side
concerns as callbacks. What a part acquires is released by its `Lifetime`, on the error path too."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from scaletrain.checkpoint import CheckpointManager, Checkpointing, FinalExport, publish_export, reply_end_ids
from scaletrain.data import build_training_data, StepBatches
from scaletrain.distributed import (
    all_gather_objects,
    sequence_shard,
)
from scaletrain.harness import LiveScores
from scaletrain.logs import interactive, set_log_level, silence_library_logs
from scaletrain.observability import (
    CommLog,
    comms_summary,
    describe_dry_run,
    GoodputLedger,
    MetricsLogger,
    PromptSamples,
    print_memory_plan,
)
from scaletrain.build import BuiltModel
from scaletrain.data import TrainingData
from scaletrain.parts import DistInfo
from scaletrain.plan import RunPlan
from scaletrain.preflight import resolve_run
from scaletrain.build import (
    Lifetime,
    begin_ledger,
    build_engine_and_runner,
    build_rank_model,
    live_scores,
    open_comm_log,
    open_ledger,
    open_metrics,
    open_checkpoints,
    nonfinite_guard,
    prepare_inputs,
    record_layout,
    start_world,
    watch_for_hangs,
    with_reference,
    write_outputs_folder,
)
from scaletrain.train import (
    preference_objective,
    CommsWindow,
    EngineStep,
    BenchmarkEvaluation,
    evaluate_sets,
    GoodputBook,
    HangNotes,
    PipelineBubble,
    loop_settings,
    NonFiniteGuard,
    PeriodicEvaluation,
    PipelineStep,
    PreemptionFlag,
    probe_applies,
    probe_for_calibration,
    ProgressBar,
    StepProfiler,
    Trainer,
    TrainingRecords,
    TrainState,
)

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from scaletrain.config import RunConfig
    from scaletrain.train import HangWatch, PreferenceObjective

log = logging.getLogger(__name__)


def plan_run(argv: Sequence[str] | None, dist: DistInfo) -> RunPlan:
    """Pre-flight: every flag, the recipe, the DeepSpeed JSON, the model's config and the tokenizer decided and
    checked (exit 2 on a mistake), before any process group or heavy work."""
    resolved = resolve_run(argv, dist)
    silence_library_logs()
    set_log_level(resolved.cfg.logging.log_level)
    return resolved


def print_plan(resolved: RunPlan) -> None:
    """--plan: per-GPU memory of each ZeRO stage and offload option, and each layout's step time, from the meta
    model."""
    cfg = resolved.cfg
    assert resolved.model_shape is not None, "the pre-flight builds the planner's model shape for --plan"
    print_memory_plan(
        cfg,
        shape=resolved.model_shape,
        block_size=resolved.block_size,
        ds=resolved.ds,
        calibration=resolved.plan_calibration,
    )


def build_run(resolved: RunPlan, *, lifetime: Lifetime) -> Run:
    """Every part of the run, built in order from the pre-flight's plan; when it returns, every part exists. What a
    part acquires is released by lifetime.close(), also when a later part fails."""
    # the preference pairs' loss: its mistakes stop the run before any work
    objective = preference_objective(resolved.cfg.preference, chat=resolved.chat)
    start_world(resolved, lifetime=lifetime)  # the process group; every rank's pre-flight verdict
    resolved, stores = prepare_inputs(resolved)  # checkpoint checksums (a damaged one: fall back), token store
    model = build_rank_model(resolved, lifetime=lifetime)  # ZeRO-3: built sharded, never whole on one rank
    # packed blocks from the store, the global order of this rank
    data = build_training_data(
        stores,
        cfg=resolved.cfg,
        ds=resolved.ds,
        dist=resolved.dist,
        block_size=resolved.block_size,
        tokenizer=resolved.tokenizer,
        resume=resolved.resume,
    )
    write_outputs_folder(resolved, data)  # resolved configs saved only after everything above succeeded
    engine, runner = build_engine_and_runner(resolved, model=model, data=data, lifetime=lifetime)
    comm_log = open_comm_log(resolved, lifetime=lifetime)  # --comms_log: from here on, training's collectives
    preemption = PreemptionFlag()  # from here a SIGUSR1/SIGTERM becomes a checkpoint at the next step boundary
    preemption.install()
    lifetime.parts.callback(preemption.uninstall)
    state = TrainState()  # what checkpoints carry: the step, the data position, the layout
    record_layout(state, resolved)
    ledger = open_ledger(resolved)  # this attempt's goodput, begun once the resume is loaded
    checkpoints = open_checkpoints(
        resolved, engine=engine, state=state, ledger=ledger, schedule=data.schedule, lifetime=lifetime
    )
    checkpoints.load_resume()  # the planned checkpoint: weights, optimizer, schedule, RNG, the data position
    metrics = open_metrics(resolved, step=state.step, restored=checkpoints.restored, lifetime=lifetime)
    checkpoints.carry(metrics)  # the wandb run id, for the next resume
    begin_ledger(ledger, step=state.step, metrics=metrics, lifetime=lifetime)
    guard = nonfinite_guard(resolved, state=state, checkpoints=checkpoints)  # its running mean is carried too
    objective = with_reference(objective, resolved, engine=engine, data=data, state=state, lifetime=lifetime)
    watch = watch_for_hangs(resolved, ledger=ledger, lifetime=lifetime)  # a stuck run ends naming who stopped
    scores = live_scores(resolved, engine=engine, metrics=metrics, watch=watch, lifetime=lifetime)
    return Run(
        resolved,
        state=state,
        model=model,
        data=data,
        engine=engine,
        runner=runner,
        objective=objective,
        comm_log=comm_log,
        preemption=preemption,
        metrics=metrics,
        ledger=ledger,
        checkpoints=checkpoints,
        guard=guard,
        watch=watch,
        scores=scores,
        lifetime=lifetime,
    )


def publish(resolved: RunPlan) -> int:
    """--push_to_hub: rank 0 uploads the export (after close: outside any collective); the exit code."""
    cfg = resolved.cfg
    repo = cfg.checkpoint.push_to_hub
    if not repo or not resolved.dist.is_main or cfg.run.dry_run:
        return 0
    return publish_export(cfg.run.output_dir, repo, cfg.checkpoint.hub_private_repo)


@dataclass
class Run:
    """One built run: the plan (`resolved`) and every part build_run made of it. It trains and ends the run
    (evaluation, save, export: the callbacks' end of training); what its parts acquired is released by the lifetime it
    was built with."""

    resolved: RunPlan
    _: KW_ONLY
    state: TrainState
    model: BuiltModel
    data: TrainingData
    engine: DeepSpeedEngine
    runner: EngineStep | PipelineStep
    objective: PreferenceObjective | None  # preference pairs: the loss and metrics of each micro-batch
    comm_log: CommLog | None  # --comms_log
    preemption: PreemptionFlag
    metrics: MetricsLogger
    ledger: GoodputLedger
    checkpoints: CheckpointManager
    guard: NonFiniteGuard
    watch: HangWatch | None  # --hang_timeout
    lifetime: Lifetime
    scores: LiveScores | None  # --lm_eval_tasks

    @property
    def cfg(self) -> RunConfig:
        return self.resolved.cfg

    @property
    def dist(self) -> DistInfo:
        return self.resolved.dist

    def train(self, *, finish: bool = True) -> None:
        """The loop, with every side concern a callback acting in the order it declares, then (`finish`) the end of
        the run: the callbacks' end of training (the last evaluation, the final checkpoint, the Hugging Face
        export), the communication totals and the calibration probe."""
        settings = loop_settings(
            self.cfg,
            dist=self.dist,
            router_loss=self.resolved.router_loss,
            start_step=self.state.step,
            total_steps=self.data.schedule.total_steps,
            objective=self.objective,
        )
        shard = None
        if self.dist.layout.sp > 1:  # each rank of a sequence-parallel group keeps its part of a block
            shard = partial(sequence_shard, sp_rank=self.dist.coords.sp, sp=self.dist.layout.sp)
        batches = StepBatches(self.data.blocks, self.data.order, self.dist.coords.dp, shard)
        trainer = Trainer(
            self.engine,
            batches=batches,
            state=self.state,
            settings=settings,
            runner=self.runner,
            callbacks=self._callbacks(),
        )
        dry = self.cfg.run.dry_run
        trainer.fit(finish=finish and not dry)  # a dry run evaluates, saves and exports nothing
        if not finish:
            return
        if dry:
            log.info(describe_dry_run(self.metrics.last_record or {}))
            return
        if self.comm_log is not None:  # every rank's totals, gathered: a slow link shows
            log.info(comms_summary(all_gather_objects(self.comm_log.totals())))
        self._probe_for_calibration()
        step, out = self.state.step, self.cfg.run.output_dir
        log.info("done: %d steps, %d tokens trained; outputs in %s", step, self.state.tokens_seen, out)

    def _probe_for_calibration(self) -> None:
        layout = self.dist.layout
        if probe_applies(self.engine, layout=layout, preference=self.objective is not None):
            probe_for_calibration(
                self.engine,
                model_config=self.resolved.model_config,
                precision=self.resolved.ds.precision,
                block_size=self.resolved.block_size,
                layout=layout,
                output_dir=self.cfg.run.output_dir,
                is_main=self.dist.is_main,
            )

    def _pipeline_bubble(self, runner: PipelineStep) -> PipelineBubble:
        layout, engine = self.dist.layout, self.engine
        return PipelineBubble(runner.times, self.dist.coords.pp, layout.pp, engine.gradient_accumulation_steps)

    def _callbacks(self) -> list:
        """The loop's side concerns, the same list on every rank; the trainer calls them in the order each declares
        (train.callbacks.Order: the guard's verdict first, the step's record before any save, evaluation before the
        checkpoint callback's commit and saves, the export last), not in the order listed here."""
        cfg, dist, dry = self.cfg, self.dist, self.cfg.run.dry_run
        evaluate = None
        if self.data.eval_sets:
            evaluator = self.runner if isinstance(self.runner, PipelineStep) else self.objective
            evaluate = partial(evaluate_sets, self.engine, self.data.eval_sets, evaluator)
        generate = None
        if self.resolved.eval_prompts is not None:
            tokenizer = self.resolved.tokenizer
            eos_ids = reply_end_ids(tokenizer)
            synced = dist.world_size > 1  # ZeRO-3 gathers in each forward: the ranks generate in step
            generate = PromptSamples(
                self.engine,
                prompts=self.resolved.eval_prompts,
                tokenizer=tokenizer,
                eos_ids=eos_ids,
                synced=synced,
                metrics=self.metrics,
            )
        callbacks = [
            *([HangNotes(self.watch)] if self.watch is not None else []),
            self.guard,
            GoodputBook(self.ledger),
            StepProfiler(cfg.logging.profile_range, cfg.run.output_dir, dist.rank),
            Checkpointing(self.checkpoints, self.preemption),  # periodic, preemption and final saves
            ProgressBar(show=dist.is_main and not cfg.logging.disable_tqdm and interactive()),
            *([CommsWindow(self.comm_log)] if self.comm_log is not None else []),
            *([self._pipeline_bubble(self.runner)] if isinstance(self.runner, PipelineStep) else []),
            TrainingRecords(self.metrics, self._throughput()),
        ]
        if not dry:  # a dry run takes one step, logged, and evaluates or saves nothing
            callbacks.append(PeriodicEvaluation(cfg.logging.eval_steps, self.metrics, evaluate, generate))
            if self.scores is not None:
                callbacks.append(BenchmarkEvaluation(cfg.lm_eval.lm_eval_steps, self.scores))
            if cfg.checkpoint.export_hf_at_end:
                callbacks.append(self._final_export())
        return callbacks

    def _throughput(self):
        from scaletrain.observability import throughput_model

        resolved, dist, cfg = self.resolved, self.dist, self.cfg
        return throughput_model(
            resolved.flops,
            accelerator=dist.accelerator,
            precision=resolved.ds.precision,
            override=cfg.logging.peak_tflops,
            recompute=cfg.model.gradient_checkpointing,
            world_size=dist.world_size,
            is_main=dist.is_main,
        )

    def _final_export(self) -> FinalExport:
        cfg, resolved = self.cfg, self.resolved
        return FinalExport(
            self.engine,
            tokenizer=resolved.tokenizer,
            model_config=resolved.model_config,
            output_dir=cfg.run.output_dir,
            is_main=self.dist.is_main,
            merge_lora=cfg.peft.merge_lora,
            trust_remote_code=cfg.model.trust_remote_code,
            metrics=self.metrics,
        )
