"""One run, phase by phase. Each phase builds its typed parts (scaletrain/parts.py) from the ones before it and
delegates to the wing that owns the concern; the trainer (train/trainer.py) then runs the loop with the run's side
concerns as callbacks, in one ordered list. What a phase acquires is released by close(), on the error path too."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.checkpoint import (
    background_writer,
    clear_previous_run,
    CommitInFlight,
    committed_step,
    complete_export,
    ensure_universal,
    export_hf_model,
    load_checkpoint,
    newest_committed,
    PeriodicSave,
    publish_export,
    read_run_config,
    reply_end_ids,
    resume_elsewhere,
    roll_back,
    Saver,
    verified_resume_checkpoint,
    write_run_folder,
)
from scaletrain.data import build_training_data, prepare_stores, StepBatches
from scaletrain.distributed import (
    all_gather_objects,
    barrier,
    broadcast_from_main,
    build_pipeline_module,
    communication_threads,
    check_tensor_groups_within_nodes,
    describe_launch,
    init_distributed,
    preflight_facts,
    register_ulysses,
    sequence_shard,
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
from scaletrain.harness import RESULTS_DIR, engine_lm, score
from scaletrain.logs import interactive, set_log_level, silence_library_logs
from scaletrain.model import (
    apply_lora,
    build_model,
    build_qlora_model,
    install_chunked_loss,
    mark_leaf_modules,
    merged_dir,
)
from scaletrain.observability import (
    attention_heads,
    measured_attention_tflops,
    CommLog,
    comms_summary,
    describe_dry_run,
    generate_samples,
    GoodputLedger,
    HostMemoryPhase,
    MetricsLogger,
    print_memory_plan,
    RunIdentity,
    write_micro_batch_probe,
)
from scaletrain.parts import BuiltModel, DistInfo, ResolvedRun, TrainingData
from scaletrain.preflight import print_config, resolve_run
from scaletrain.train import (
    CommsWindow,
    EngineStep,
    enable_flight_recorder,
    BenchmarkEvaluation,
    evaluate_sets,
    GoodputBook,
    HangNotes,
    PipelineBubble,
    loop_settings,
    micro_batch_fixed_seconds,
    NonFiniteGuard,
    NonFinitePolicy,
    PeriodicEvaluation,
    PipelineStep,
    PreemptionFlag,
    PreemptionSave,
    PROBE_TOKENS,
    preference_objective,
    prepare_reference,
    ProgressBar,
    seed_everything,
    start_hang_watch,
    StepProfiler,
    Trainer,
    TrainingRecords,
    TrainState,
)

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from scaletrain.config import RunConfig
    from scaletrain.train import HangWatch

log = logging.getLogger(__name__)


class Run:
    """The phases of one run and what each built: `resolved` (the pre-flight's decisions, replaced by a new value
    when a phase learns more), then the stores, the model, the data, the engine with its step runner, and the sinks
    the loop reports to. Each part is set once, by the phase named beside it."""

    def __init__(self, resolved: ResolvedRun):
        self.resolved = resolved
        self.state = TrainState()  # what checkpoints carry: the step, the data position, the layout
        self._record_layout()
        self.objective = preference_objective(resolved)  # preference pairs: the loss and metrics of each micro-batch
        self.preemption = PreemptionFlag()
        self._closing = ExitStack()  # what the phases acquired, released in reverse by close()
        self.exit_code = 1  # the process's, for the sinks that record how the run ended (a crash unless told)
        self.stores: tuple = ()  # prepare_inputs
        self.model: BuiltModel | None = None  # build_model
        self.data: TrainingData | None = None  # build_data
        self.engine: DeepSpeedEngine | None = None  # build_engine
        self.runner: EngineStep | PipelineStep | None = None  # build_engine
        self.comm_log: CommLog | None = None  # build_engine (--comms_log)
        self.metrics: MetricsLogger | None = None  # resume
        self.ledger = GoodputLedger(resolved.cfg.run.output_dir, is_main=False, started=0.0)  # resume: this attempt's
        self.saver: Saver | None = None  # resume
        self.watch: HangWatch | None = None  # watch_for_hangs (--hang_timeout)
        self.harness_lm = None  # the live model as lm-eval's LM (--lm_eval_tasks), built at its first evaluation

    @classmethod
    def from_flags(cls, argv: Sequence[str] | None, dist: DistInfo) -> Run:
        resolved = resolve_run(argv, dist)
        silence_library_logs()
        set_log_level(resolved.cfg.logging.log_level)
        return cls(resolved)

    @property
    def cfg(self) -> RunConfig:
        return self.resolved.cfg

    @property
    def dist(self) -> DistInfo:
        return self.resolved.dist

    def _record_layout(self) -> None:
        """The layout this run trains with, into the train state its checkpoints carry."""
        ds = self.resolved.ds
        self.state.record_layout(self.dist.layout, ds.zero_stage, ds.offload_setting)

    def print_config(self) -> None:
        print_config(self.resolved)

    def print_memory_plan(self) -> None:
        resolved = self.resolved
        print_memory_plan(self.cfg, resolved.model_shape, resolved.block_size, resolved.ds, resolved.plan_calibration)

    def init_distributed(self) -> None:
        """The process group, then every rank's pre-flight verdict: a rank whose pre-flight failed joins too
        (distributed.stop_with_the_others), so its mistake stops every rank here; the ranks also compare the resume
        checkpoint, tokenizer and run configuration each found, before any rank acts on them."""
        enable_flight_recorder(self.cfg.run.output_dir)  # on a GPU: NCCL's trace, for a hang's report
        dist = init_distributed(self.dist, self.cfg.hang.ddp_timeout)
        self.resolved = self.resolved.replace(dist=dist)  # the accelerator is known now
        self._closing.callback(self._check_teardown)
        self._closing.callback(teardown_distributed, dist.rank)
        self._closing.callback(self._drop_parts)  # nothing of ours holds a process group past the teardown
        settle(dist, facts=preflight_facts(self.resolved))
        hosts = describe_launch(self.resolved)  # the run's first lines: where the ranks landed, what each runs with
        check_tensor_groups_within_nodes(self.cfg.parallel, dist.layout, hosts)
        if self.cfg.engine.cpu_shm_allreduce:  # after the rendezvous: every rank decides on the same facts
            shm = use_shm_allreduce(dist)
            if shm is not None:
                self._closing.callback(self._release_shm_allreduce, shm)
        seed_everything(self.cfg.optim.seed)

    def prepare_inputs(self) -> None:
        """The resume conversion and the token store, then the ranks settle: a failure on any rank (a node whose
        store could not be prepared) stops every rank, and so do token stores that differ between ranks."""
        error = None
        try:
            self.prepare_resume()
            self.stores = prepare_stores(self.resolved)
        except RunEnded as err:
            error = err
        settle(self.dist, error, None if error else store_facts(self.stores))

    def prepare_resume(self) -> None:
        """The checkpoint's files checked against their SHA-256 by every rank (a share each) before anything reads
        them: a damaged one falls back, on every rank, to the previous committed checkpoint (or stops the run).
        Then a checkpoint from another number of ranks, layout or offload is converted to DeepSpeed's universal
        format (global rank 0 converts; the others wait on the file system, with a way out if rank 0 fails)."""
        resume = self.resolved.resume
        if resume is None:
            return
        auto = self.cfg.checkpoint.resume_from_checkpoint == "auto"
        verified = verified_resume_checkpoint(resume.checkpoint, auto, self.dist.rank, self.dist.world_size)
        if verified != resume.checkpoint:
            self.resolved = resume_elsewhere(self.resolved, verified)
        if self.resolved.resume.reshard:
            ensure_universal(self.resolved.resume.checkpoint, self.dist.rank)

    def build_model(self) -> None:
        """This rank's model (ZeRO-3: built sharded; pipeline: its stage alone), with LoRA and the layout's
        attention and stage wrappers."""
        memory = HostMemoryPhase("model build")
        resolved, cfg, layout = self.resolved, self.cfg, self.dist.layout
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
            self._closing.callback(register_ulysses(module, resolved))
        pipeline_loss = None
        if layout.pp > 1:  # this rank keeps its stage's layers of the model it built
            module, pipeline_loss = build_pipeline_module(
                module, layout, cfg.parallel.pipeline_partition, cfg.model.loss_chunk_size
            )
        self.model = BuiltModel(module, keepalive, pipeline_loss)
        memory.report()

    def build_data(self) -> None:
        self.data = build_training_data(self.resolved, self.stores)

    def write_run_folder(self) -> None:
        """The resolved configs saved beside the outputs, only after everything above succeeded."""
        if self.cfg.run.dry_run:
            return  # a dry run leaves the output folder as it was
        if self.resolved.resume is None and self.cfg.run.overwrite_output_dir and self.dist.is_main:
            clear_previous_run(self.cfg.run.output_dir)  # an explicit fresh start in a used folder
        schedule = self.data.schedule
        write_run_folder(self.resolved, {"total_steps": schedule.total_steps, "warmup_steps": schedule.warmup_steps})
        barrier()  # the folder exists before any rank writes into it

    def build_engine(self) -> None:
        """deepspeed.initialize with the resolved config and LR schedule, the step runner, and what goes with them."""
        cfg, ds = self.cfg, self.resolved.ds
        self.engine = build_engine(
            self.model.module, ds.config, cfg.optim.weight_decay, self.data.schedule, self.dist.layout
        )
        self._closing.callback(self._release_engine)
        switch = SkipSwitch(self.engine.optimizer) if cfg.nonfinite.on_nonfinite == "skip" else None
        if self.model.pipeline_loss is not None:
            self.runner = PipelineStep(self.engine, self.model.pipeline_loss, switch)
        else:  # after deepspeed.initialize (tensor parallelism may replace the head), before compile
            self.runner = EngineStep(switch)
            install_chunked_loss(self.engine.module, cfg.model.loss_chunk_size)
        if compile_requested(cfg.engine.torch_compile, ds.config):
            compile_engine(self.engine, cfg.engine.torch_compile_backend, cfg.engine.torch_compile_mode)
        if cfg.logging.comms_log:  # from here on: the engine's start-up broadcasts are not training's
            self.comm_log = CommLog(self.dist.layout)
            self._closing.callback(self.comm_log.close)
        # From here a SIGUSR1/SIGTERM becomes a checkpoint at the next step boundary instead of a lost run.
        self.preemption.install()
        self._closing.callback(self.preemption.uninstall)

    def resume(self) -> None:
        """Restore the newest committed checkpoint (or the one asked for; every rank loads its own shards), then
        open this attempt's sinks: the metrics, the goodput ledger and the saver."""
        resume, cfg, dist = self.resolved.resume, self.cfg, self.dist
        if resume is not None:
            load_checkpoint(self.engine, resume.checkpoint, self.state, dist.rank, universal=resume.reshard)
            self._reloaded(resume.reshard)
        dry, out = cfg.run.dry_run, cfg.run.output_dir
        identity = RunIdentity(cfg.run.run_name or Path(out).resolve().name, cfg.to_dict(), self.state.wandb_run_id)
        self.metrics = MetricsLogger(
            out, dist.is_main, cfg.logging.report_sinks, identity, resume_step=self.state.step, write_files=not dry
        )
        self._closing.callback(lambda: self.metrics.close(self.exit_code))
        self.state.wandb_run_id = self.metrics.wandb_run_id
        self.ledger = GoodputLedger(out, dist.is_main and not dry)
        self.ledger.begin(self.state.step)
        self._closing.callback(lambda: self.ledger.end(self.exit_code, self.metrics))
        ds = self.resolved.ds
        writer = None
        if cfg.checkpoint.async_save and not dry:
            writer = background_writer(self.resolved.n_params, ds.precision, ds.zero_stage, dist)
        self.saver = Saver(self.resolved, self.engine, self.state, self.ledger, writer)
        self._closing.callback(self.saver.close)

    def reference_log_probs(self) -> None:
        """Preference pairs: the reference's log-probs of every pair, read back or computed once before step 1."""
        if self.objective is None:
            return
        only = None
        if self.cfg.run.dry_run:
            only = self.data.order.global_batch_indices(self.state.step + self.state.data_offset)
        reference = prepare_reference(self.engine, self.resolved, self.data, self.state.step == 0, only)
        self.objective = dataclasses.replace(self.objective, reference=reference)
        if reference is not None:  # a live reference's own engine
            self._closing.callback(release_engine, reference)

    def watch_for_hangs(self) -> None:
        """--hang_timeout: this rank's heartbeat, and a watch that ends a stuck run naming the ranks that stopped."""
        if self.cfg.run.dry_run:
            return
        on_hang = partial(self.ledger.end, HANG_EXIT_CODE)  # the attempt's end in goodput.json
        self.watch = start_hang_watch(self.cfg.hang, self.cfg.run.output_dir, self.dist, on_hang)
        if self.watch is not None:
            self._closing.callback(self.watch.stop)

    def train(self) -> None:
        """The loop, with every side concern a callback, in the order each acts after a step."""
        settings = loop_settings(self.resolved, self.state.step, self.data.schedule.total_steps, self.objective)
        shard = None
        if self.dist.layout.sp > 1:  # each rank of a sequence-parallel group keeps its part of a block
            shard = partial(sequence_shard, sp_rank=self.dist.coords.sp, sp=self.dist.layout.sp)
        batches = StepBatches(self.data.blocks, self.data.order, self.dist.coords.dp, shard)
        trainer = Trainer(self.engine, batches, self.state, settings, self.runner, self._callbacks())
        trainer.fit()

    def _pipeline_bubble(self) -> PipelineBubble:
        layout, engine = self.dist.layout, self.engine
        return PipelineBubble(self.runner.times, self.dist.coords.pp, layout.pp, engine.gradient_accumulation_steps)

    def _callbacks(self) -> list:
        """The loop's side concerns, the same list on every rank: their order is the order each acts after a step
        (the guard's verdict first, the step's record before a preemption save, evaluation before a periodic
        save)."""
        cfg, dist, dry = self.cfg, self.dist, self.cfg.run.dry_run
        policy = NonFinitePolicy.from_args(cfg.nonfinite, fp16=self.resolved.ds.precision == "fp16")
        guard = NonFiniteGuard(
            policy, self.state, cfg.run.output_dir, dist.is_main, write_files=not dry, rollback=self.rollback
        )
        evaluate = None
        if self.data.eval_sets:
            evaluator = self.runner if isinstance(self.runner, PipelineStep) else self.objective
            evaluate = partial(evaluate_sets, self.engine, self.data.eval_sets, evaluator)
        generate = self.generate_samples if self.resolved.eval_prompts else None
        callbacks = [
            *([HangNotes(self.watch)] if self.watch is not None else []),
            guard,
            GoodputBook(self.ledger),
            StepProfiler(cfg.logging.profile_range, cfg.run.output_dir, dist.rank),
            CommitInFlight(self.saver),
            ProgressBar(show=dist.is_main and not cfg.logging.disable_tqdm and interactive()),
            *([CommsWindow(self.comm_log)] if self.comm_log is not None else []),
            *([self._pipeline_bubble()] if isinstance(self.runner, PipelineStep) else []),
            TrainingRecords(self.metrics, self._throughput()),
        ]
        if not dry:  # a dry run takes one step, logged, and evaluates or saves nothing
            callbacks.append(PeriodicEvaluation(cfg.logging.eval_steps, self.metrics, evaluate, generate))
            if self.resolved.lm_eval_tasks is not None:
                callbacks.append(BenchmarkEvaluation(cfg.lm_eval.lm_eval_steps, self.score_benchmarks))
            callbacks.append(PeriodicSave(self.saver, cfg.checkpoint.save_steps, cfg.checkpoint.save_interval_minutes))
        # Last: a save due at the preemption's step is the one it commits (once), without a second write.
        preemption = PreemptionSave(
            self.preemption, partial(self.saver.save, now=True), cfg.checkpoint.preemption_grace_seconds
        )
        return [*callbacks, preemption]

    def _throughput(self):
        from scaletrain.observability import throughput_model

        resolved, dist, cfg = self.resolved, self.dist, self.cfg
        return throughput_model(
            resolved.flops,
            dist.accelerator,
            resolved.ds.precision,
            cfg.logging.peak_tflops,
            cfg.model.gradient_checkpointing,
            dist.world_size,
            dist.is_main,
        )

    def generate_samples(self, step: int) -> None:
        """--eval_prompts: every rank generates (ZeRO-3 gathers in each forward); rank 0 records the text."""
        tokenizer = self.resolved.tokenizer
        synced = self.dist.world_size > 1
        rows = generate_samples(self.engine, self.resolved.eval_prompts, tokenizer, reply_end_ids(tokenizer), synced)
        self.metrics.log_generations(step, rows)

    def score_benchmarks(self, step: int) -> None:
        """--lm_eval_tasks: lm-evaluation-harness on the live model, every rank scoring its share of the requests;
        rank 0 logs each task's metrics and writes lm-eval's JSON to <output_dir>/lm_eval/step<N>.json."""
        args, dist = self.cfg.lm_eval, self.dist
        if self.harness_lm is None:
            watch = self.watch
            progress = (lambda what: watch.phase(f"lm-eval: {what}", long=True)) if watch is not None else None
            lockstep = self.resolved.ds.zero_stage == 3 and dist.layout.dp > 1  # each forward a collective
            self.harness_lm = engine_lm(
                self.engine.module,
                self.resolved.tokenizer,
                args.lm_eval_batch_size,
                rank=dist.coords.dp,
                world_size=dist.layout.dp,
                lockstep=lockstep,
                progress=progress,
            )
            self._closing.callback(self.harness_lm.close)
        tasks, out = self.resolved.lm_eval_tasks, Path(self.cfg.run.output_dir)
        bars = dist.is_main and not self.cfg.logging.disable_tqdm and interactive()
        scores = score(self.harness_lm, tasks, args, out, f"step{step}", step, show_bars=bars)
        if scores is not None:
            self.metrics.log({"step": step, **scores.metrics})

    def rollback(self) -> dict:
        """--max_consecutive_skips reached: back to the newest committed checkpoint, the data past the streak; the
        jump's entry for the non-finite ledger."""
        self.saver.commit_pending(wait=True)  # a save in flight is committed first: it may be the one to go back to
        self.saver.wait_for_pruning()  # the checkpoints folder holds what it will hold when rank 0 looks
        jump = roll_back(self.engine, self.state, self.resolved, self._reloaded)
        self.saver.committed = None  # (a fallback past a damaged newest one retrains its step on other data)
        return jump

    def _reloaded(self, universal: bool) -> None:
        """After a checkpoint was loaded (resume, rollback): this run's flags rule from here on. A universal load
        restores no weight decay and (ZeRO-3) shares one Adam step counter: repaired here. The checkpoint restored the
        saving run's peak LR and next LR."""
        if universal:
            repair_universal_load(self.engine, self.cfg.optim.weight_decay)
        restart_schedule(self.engine.lr_scheduler, self.data.schedule, self.resolved.ds.peak_lr)
        self._record_layout()

    def finish(self) -> None:
        """The end of the run: the last step's evaluation, its checkpoint and the Hugging Face export."""
        if self.cfg.run.dry_run:
            log.info(describe_dry_run(self.metrics.last_record or {}))
            return
        if self.watch is not None:
            self.watch.phase("end of run: evaluation, save, export", long=True)
        self.saver.commit_pending(wait=True)  # --async_save: the save in flight is committed before anything else
        self.saver.wait_for_pruning()
        # Decided once, by rank 0: ranks that disagreed about entering a collective save or evaluation would hang in
        # it. A run resumed at its last step (already complete) has evaluated it: its records are not repeated.
        step, out = self.state.step, self.cfg.run.output_dir
        scored_file = Path(out) / RESULTS_DIR / f"step{step}.json"
        newest, evaluated, scored = broadcast_from_main(
            (newest_committed(out), self.metrics.evaluated(step), scored_file.is_file()) if self.dist.is_main else None
        )
        evaluation_started = time.perf_counter()
        if self.data.eval_sets and not evaluated:
            evaluator = self.runner if isinstance(self.runner, PipelineStep) else self.objective
            self.metrics.log({"step": step, **evaluate_sets(self.engine, self.data.eval_sets, evaluator)})
        if self.resolved.eval_prompts and not evaluated:
            self.generate_samples(step)
        if self.resolved.lm_eval_tasks is not None and not scored:
            self.score_benchmarks(step)
        self.ledger.evaluation(time.perf_counter() - evaluation_started)  # the final evaluation is evaluation too
        if self.cfg.checkpoint.save_at_end and (newest is None or committed_step(newest) != step):
            self.saver.save(now=True)
        if self.cfg.checkpoint.export_hf_at_end:
            self._export()
        if self.comm_log is not None:  # every rank's totals, gathered: a slow link shows
            log.info(comms_summary(all_gather_objects(self.comm_log.totals())))
        self._probe_for_calibration()
        log.info("done: %d steps, %d tokens trained; outputs in %s", step, self.state.tokens_seen, out)

    def _probe_for_calibration(self) -> None:
        """What --plan_calibration needs beside the steps' phases, measured once everything of the run is saved: the
        fixed cost of a micro-batch (train.step.micro_batch_fixed_seconds) and the fused attention's rate at the
        run's shape, in the run folder. Not where a micro-batch takes another path (the pipeline's schedule,
        sequence-parallel shards, preference pairs) or where a new shape would recompile."""
        import torch

        layout = self.dist.layout
        if layout.pp > 1 or layout.sp > 1 or self.objective is not None or self.engine.is_compiled:
            return
        seconds = micro_batch_fixed_seconds(self.engine)
        heads, head_dim = attention_heads(self.resolved.model_config)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.resolved.ds.precision]
        micro_batch, block = self.engine.train_micro_batch_size_per_gpu(), self.resolved.block_size
        attention = None
        if heads and head_dim:  # a model that names its attention's shape
            heads //= layout.tp
            attention = measured_attention_tflops(self.engine.device, dtype, micro_batch, heads, block, head_dim)
            log.info("attention at %.3g TFLOP/s (%d x %d tokens, %d heads)", attention, micro_batch, block, heads)
        log.info("a micro-batch's fixed cost: %.3g ms (one %d-token sequence)", seconds * 1e3, PROBE_TOKENS)
        if self.dist.is_main:
            write_micro_batch_probe(self.cfg.run.output_dir, seconds, PROBE_TOKENS, attention)

    def _export(self) -> None:
        """The Hugging Face folder, completed on rank 0 with a generation config and a model card."""
        cfg, resolved = self.cfg, self.resolved
        out, merged = cfg.run.output_dir, cfg.peft.merge_lora
        export_hf_model(self.engine, resolved.tokenizer, out, self.dist.is_main, merged, cfg.model.trust_remote_code)
        if self.dist.is_main:  # the folder is complete and publishable
            run_config = read_run_config(out)
            for folder in (out, *([merged_dir(out)] if merged else [])):
                complete_export(folder, resolved.tokenizer, resolved.model_config, run_config, self.metrics.latest)

    def publish(self) -> int:
        """--push_to_hub: rank 0 uploads the export (after close(): outside any collective); the exit code."""
        repo = self.cfg.checkpoint.push_to_hub
        if not repo or not self.dist.is_main or self.cfg.run.dry_run:
            return 0
        return publish_export(self.cfg.run.output_dir, repo, self.cfg.checkpoint.hub_private_repo)

    def close(self, exit_code: int = 0) -> None:
        """Free everything the phases acquired, in reverse order, on the error path too; `exit_code` (the
        process's) goes to the goodput ledger and wandb."""
        self.exit_code = exit_code
        self._closing.close()

    def _release_engine(self) -> None:
        # The engine, optimizer and ZeRO-3 parameters hold process groups, so destroy_process_group alone left
        # gloo's threads running until the interpreter tore the objects down at exit, which now and then aborted
        # a finished run (SIGABRT, "terminate called without an active exception"). Free them here instead.
        try:
            release_engine(self.engine)
        except Exception as err:  # never hide the error that brought us here, nor skip the teardown
            log.warning("could not release the DeepSpeed engine cleanly: %s", err)

    def _drop_parts(self) -> None:
        self.engine = self.model = self.runner = self.objective = self.saver = self.harness_lm = None

    @staticmethod
    def _release_shm_allreduce(shm) -> None:
        log.info("cpu: %d all-reduces (%.2f GB) went through shared memory", shm.calls, shm.bytes / 1e9)
        shm.uninstall()

    @staticmethod
    def _check_teardown() -> None:
        lingering = communication_threads()
        if lingering:
            log.warning(
                "%d communication threads outlive the process group: something still holds it, and the "
                "interpreter will tear it down at exit",
                lingering,
            )
