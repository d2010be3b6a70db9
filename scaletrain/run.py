"""One run, phase by phase. Each method delegates to the module that owns the concern; this class only holds
what one phase hands to the next, so train.py can read as a table of contents."""

from __future__ import annotations

import dataclasses
import json
import logging
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from scaletrain.checkpoint import (
    background_writer,
    BackgroundWriter,
    checkpoint_parameters,
    clear_previous_run,
    committed_step,
    complete_export,
    ensure_universal,
    export_hf_model,
    load_checkpoint,
    newest_committed,
    offload_setting,
    planned_checkpoint_bytes,
    publish_export,
    reply_end_ids,
    roll_back,
    save_checkpoint,
    settle_checkpoint,
    start_checkpoint,
    verified_resume_checkpoint,
)
from scaletrain.data import (
    attach_masks,
    BatchRamp,
    describe_data,
    ensure_token_store,
    GlobalOrder,
    open_store,
    PackedBlocks,
    StepBatches,
    store_plan,
    training_blocks,
    validation_sets,
)
from scaletrain.distributed import (
    all_gather_objects,
    barrier,
    broadcast_from_main,
    build_pipeline_module,
    communication_threads,
    DistInfo,
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
    describe_schedule_change,
    LRSchedule,
    release_engine,
    restart_schedule,
    repair_universal_load,
    SkipSwitch,
    schedule_for,
)
from scaletrain.model import apply_lora, base_identity, build_model, build_qlora_model, mark_leaf_modules, merged_dir
from scaletrain.errors import HANG_EXIT_CODE, RunEnded
from scaletrain.logs import silence_library_logs
from scaletrain.train import (
    enable_flight_recorder,
    start_hang_watch,
    evaluate_sets,
    seed_everything,
    LoopHooks,
    loop_settings,
    NonFiniteGuard,
    NonFinitePolicy,
    PipelineStep,
    PreemptionFlag,
    preference_objective,
    prepare_reference,
    train_loop,
    TrainState,
)
from scaletrain.observability import (
    comms_summary,
    describe_dry_run,
    GoodputLedger,
    HostMemoryPhase,
    generate_samples,
    MetricsLogger,
    StepProfiler,
)
from scaletrain.preflight import (
    RUN_CONFIG_FILE,
    ResolvedRun,
    describe_launch,
    peak_lr,
    print_config,
    print_memory_plan,
    resolve_run,
    resume_elsewhere,
    write_run_folder,
)

log = logging.getLogger(__name__)


class Run:
    def __init__(self, resolved: ResolvedRun):
        self.resolved = resolved
        self.cfg = resolved.cfg
        self.dist = dist = resolved.dist  # the launch with this run's layout
        self.model: Any = None
        self._zero3_keepalive: Any = None
        self._shm_allreduce: Any = None  # ds_internals.ShmAllReduce where --cpu_shm_allreduce is in use
        self.stores: list = []
        self.train_blocks: PackedBlocks | None = None
        self.eval_sets: dict = {}  # {validation split: EvalBatches}
        self.order: GlobalOrder | None = None
        self.schedule: LRSchedule | None = None
        self.engine: Any = None
        self.pipeline_loss: Any = None  # the pipe engine's loss_fn, under pipeline parallelism
        self.pipeline_step: PipelineStep | None = None
        self.comm_log: Any = None  # --comms_log
        self.metrics: MetricsLogger | None = None
        # goodput.json (where the wall-clock time went): resume() starts this attempt's; until then, one writing nothing
        self.ledger = GoodputLedger(self.cfg.run.output_dir, is_main=False, started=0.0)
        self.state = TrainState(world_size=dist.dp_world_size)
        self._record_layout()
        self.preemption = PreemptionFlag()
        self.guard: NonFiniteGuard | None = None
        self.watch: Any = None  # train.hang.HangWatch, from watch_for_hangs() (--hang_timeout)
        self.writer: BackgroundWriter | None = None  # --async_save: this rank's writer process, from resume()
        self._in_flight_step_s = 0.0  # the ledger's step seconds when the save in flight was taken
        self.objective = preference_objective(resolved)  # preference pairs: the loss and metrics of each micro-batch

    @classmethod
    def from_flags(cls, argv: Sequence[str] | None, dist: DistInfo) -> Run:
        resolved = resolve_run(argv, dist)
        silence_library_logs()
        return cls(resolved)

    def _record_layout(self) -> None:
        """The layout this run trains with, into the train state its checkpoints carry."""
        self.state.world_size = self.dist.dp_world_size
        self.state.tensor_parallel_size = self.dist.tensor_parallel_size
        self.state.sequence_parallel_size = self.dist.sequence_parallel_size
        self.state.pipeline_parallel_size = self.dist.pipeline_parallel_size
        self.state.zero_stage = self.resolved.ds.zero_stage
        self.state.offload = offload_setting(self.resolved.ds)

    def print_config(self) -> None:
        print_config(self.resolved, self.dist)

    def print_memory_plan(self) -> None:
        print_memory_plan(self.resolved)

    def init_distributed(self) -> None:
        """The process group, then every rank's pre-flight verdict: a rank whose pre-flight failed joins too
        (distributed.stop_with_the_others), so its mistake stops every rank here; the ranks also compare the resume
        checkpoint, tokenizer and run configuration each found, before any rank acts on them."""
        enable_flight_recorder(self.cfg.run.output_dir)  # on a GPU: NCCL's trace, for a hang's report
        self.dist = init_distributed(self.dist, self.cfg.hang.ddp_timeout)
        settle(self.dist, facts=preflight_facts(self.resolved))
        if self.cfg.engine.cpu_shm_allreduce:  # after the rendezvous: every rank decides on the same facts
            self._shm_allreduce = use_shm_allreduce(self.dist)
        describe_launch(self.resolved, self.dist)
        seed_everything(self.cfg.optim.seed)

    def build_model(self) -> None:
        memory = HostMemoryPhase("model build")
        # The backend the pre-flight's meta model was built with: the one named, or the one transformers chose.
        args = dataclasses.replace(self.cfg.model, attn_implementation=self.resolved.attn_implementation)
        if self.cfg.peft.load_in_4bit:  # QLoRA: the base in 4 bits on this rank's GPU, then LoRA as below
            self.model, self._zero3_keepalive = build_qlora_model(args, self.resolved.model_config, self.resolved.ds)
        else:
            pipeline = self.dist.pipeline_parallel_size > 1 and not self.cfg.peft.use_peft  # stages built alone
            self.model, self._zero3_keepalive = build_model(
                args, self.resolved.model_config, self.resolved.ds.config, self.resolved.ds.zero_stage, pipeline
            )
        if self.cfg.peft.use_peft:  # LoRA: peft wraps the built (ZeRO-3: partitioned) model; only the adapter trains
            self.model = apply_lora(self.model, self.cfg.peft)
        if self.resolved.ds.zero_stage == 3:  # before deepspeed.initialize, which installs the gather hooks
            mark_leaf_modules(self.model, self.resolved.model_config)
        if self.dist.sequence_parallel_size > 1:
            register_ulysses(
                self.model,
                self.dist.sequence_parallel_size,
                self.resolved.ds.config["train_micro_batch_size_per_gpu"],
                self.resolved.block_size,
                self.cfg.data.attention_isolation or self.resolved.chat is not None,
            )
        if self.dist.pipeline_parallel_size > 1:  # this rank keeps its stage's layers of the model it built
            self.model, self.pipeline_loss = build_pipeline_module(
                self.model, self.dist.pipeline_parallel_size, self.cfg.parallel.pipeline_partition
            )
        memory.report()

    def prepare_inputs(self) -> None:
        """The resume conversion and the token store, then the ranks settle: a failure on any rank (a node whose
        store could not be prepared) stops every rank, and so do token stores that differ between ranks."""
        error = None
        try:
            self.prepare_resume()
            self.prepare_data()
        except RunEnded as err:
            error = err
        settle(self.dist, error, None if error else store_facts(self.stores))

    def prepare_resume(self) -> None:
        """The checkpoint's files checked against their SHA-256 by every rank (a share each) before anything reads
        them: a damaged one falls back, on every rank, to the previous committed checkpoint (or stops the run).
        Then a checkpoint from another number of ranks, layout or offload is converted to DeepSpeed's universal
        format (global rank 0 converts; the others wait on the file system, with a way out if rank 0 fails)."""
        chosen = self.resolved.resume_from
        if chosen is None:
            return
        verified = verified_resume_checkpoint(
            chosen, self.cfg.checkpoint.resume_from_checkpoint == "auto", self.dist.rank, self.dist.world_size
        )
        if verified != chosen:
            self.resolved = resume_elsewhere(self.resolved, verified)
        if self.resolved.reshard:
            ensure_universal(self.resolved.resume_from, self.dist.rank)

    def prepare_data(self) -> None:
        """Token stores: --data_path or --dataset_mix as given, or raw data prepared once (local rank 0 of each
        node prepares; the others wait on the file system, with a way out if it fails or dies)."""
        paths = [Path(p) for p in self.cfg.data.store_paths]
        if not paths:
            chat = self.resolved.chat and store_plan(  # chat data: tokens and a loss mask
                self.cfg.data,
                self.resolved.tokenizer,
                self.resolved.block_size,
                self.resolved.chat,
                show_progress=self.dist.is_main,
            )
            paths = [
                ensure_token_store(
                    self.cfg.data,
                    self.resolved.tokenizer,
                    self.cfg.model.tokenizer_source,
                    self.resolved.block_size,
                    self.dist.local_rank,
                    show_progress=self.dist.is_main,
                    seed=self.cfg.optim.seed,
                    **(chat or {}),
                )
            ]
        self.stores = [open_store(p) for p in paths]
        self.stores = [attach_masks(s, p) for s, p in zip(self.stores, paths, strict=True)]  # chat data
        log.info("token store(s): %s", ", ".join(map(str, paths)))

    def build_data(self) -> None:
        """Packed blocks from the stores, this rank's view of the global order, the LR schedule's length and the
        fixed evaluation set."""
        data, optim, dist, size = self.cfg.data, self.cfg.optim, self.dist, self.resolved.block_size
        self.train_blocks = training_blocks(self.stores, data, size, optim.seed, self.resolved.tokenizer)
        # Batch sizes as DeepSpeed will use them: an explicit JSON value stands where the flag was not typed.
        micro = self.resolved.ds.config["train_micro_batch_size_per_gpu"]
        accumulation = self.resolved.ds.config["gradient_accumulation_steps"]
        resumed = self.resolved.resume_state or {}
        ramp = optim.rampup_batch_size and BatchRamp(
            *optim.rampup_batch_size, full=micro * accumulation * dist.dp_world_size
        )
        self.order = GlobalOrder(
            len(self.train_blocks),
            micro,
            accumulation,
            dist.dp_world_size,
            optim.seed,
            start_step=resumed.get("step", 0) + resumed.get("data_offset", 0),
            start_samples=resumed.get("samples_seen", 0),
            ramp=ramp or None,
        )
        total = optim.max_steps if optim.max_steps > 0 else self.order.total_steps(optim.num_train_epochs)
        self.schedule = schedule_for(
            optim.lr_scheduler_type,
            total,
            optim.warmup_steps,
            optim.warmup_ratio,
            optim.min_lr_ratio,
            optim.decay_ratio,
        )
        changed = self.resolved.previous_run_config and describe_schedule_change(
            self.resolved.previous_run_config,
            self.schedule,
            peak_lr(self.resolved.ds),
            resumed.get("step", 0),
            resumed.get("skipped_steps", 0),
        )
        if changed and dist.is_main:  # every rank computes the same: say it once
            log.warning(changed)
        self.eval_sets = validation_sets(
            self.stores,
            data,
            size,
            optim.per_device_eval_batch_size,
            dist.dp_rank,
            dist.dp_world_size,
            self.cfg.logging.max_eval_samples,
        )
        log.info(describe_data(self.train_blocks, self.order, micro, accumulation, dist.dp_world_size, total))
        if ramp:
            stages = self.order.stages
            log.info("batch ramp-up: %s", ", ".join(f"{s.global_batch} from step {s.start_step}" for s in stages))

    def write_run_folder(self) -> None:
        if self.cfg.run.dry_run:
            return  # a dry run leaves the output folder as it was
        if self.resolved.resume_from is None and self.cfg.run.overwrite_output_dir and self.dist.is_main:
            clear_previous_run(self.cfg.run.output_dir)  # an explicit fresh start in a used folder
        write_run_folder(
            self.resolved,
            {
                "total_steps": self.schedule.total_steps,
                "warmup_steps": self.schedule.warmup_steps,
                "world_size": self.dist.world_size,
                "precision": self.resolved.ds.precision,
            },
            self.dist,
        )
        barrier()  # the folder exists before any rank writes into it

    def build_engine(self) -> None:
        self.engine = build_engine(
            self.model,
            self.resolved.ds.config,
            self.cfg.optim.weight_decay,
            self.schedule,
            self.dist.tensor_parallel_size,
        )
        if self.pipeline_loss is not None:
            self.pipeline_step = PipelineStep(self.engine, self.pipeline_loss)
        else:  # after deepspeed.initialize (tensor parallelism may replace the head), before compile
            from scaletrain.model import install_chunked_loss

            install_chunked_loss(self.engine.module, self.cfg.model.loss_chunk_size)
        engine_args = self.cfg.engine
        if compile_requested(engine_args.torch_compile, self.resolved.ds.config):
            compile_engine(self.engine, engine_args.torch_compile_backend, engine_args.torch_compile_mode)
        if self.cfg.logging.comms_log:  # from here on: the engine's start-up broadcasts are not training's
            from scaletrain.observability import CommLog

            self.comm_log = CommLog()
        # From here a SIGUSR1/SIGTERM becomes a checkpoint at the next step boundary instead of a lost run.
        self.preemption.install()

    def resume(self) -> None:
        """Restore the newest committed checkpoint (or the one asked for); every rank loads its own shards."""
        if self.resolved.resume_from is not None:
            load_checkpoint(
                self.engine, self.resolved.resume_from, self.state, self.dist.rank, universal=self.resolved.reshard
            )
            self._reloaded(self.resolved.reshard)
        self.metrics = MetricsLogger(
            self.cfg.run.output_dir,
            self.dist.is_main,
            self.cfg.logging.report_sinks,
            self.cfg.run.run_name or Path(self.cfg.run.output_dir).resolve().name,
            self.cfg.to_dict(),
            resume_step=self.state.step,
            wandb_run_id=self.state.wandb_run_id,
            write_files=not self.cfg.run.dry_run,
        )
        self.state.wandb_run_id = self.metrics.wandb_run_id
        self.ledger = GoodputLedger(self.cfg.run.output_dir, self.dist.is_main and not self.cfg.run.dry_run)
        self.ledger.begin(self.state.step)
        ckpt, ds = self.cfg.checkpoint, self.resolved.ds
        if ckpt.async_save and not self.cfg.run.dry_run:
            self.writer = background_writer(self.resolved.n_params, ds.precision, ds.zero_stage, self.dist)

    def reference_log_probs(self) -> None:
        """Preference pairs: the reference's log-probs of every pair, read back or computed once before step 1."""
        if self.objective is not None:
            fresh, store, dry = self.state.step == 0, self.stores[0]["path"], self.cfg.run.dry_run
            only = self.order.global_batch_indices(self.state.step + self.state.data_offset) if dry else None
            reference = prepare_reference(
                self.engine, self.resolved, self.dist, self.train_blocks, self.eval_sets, store, fresh, only
            )
            self.objective = dataclasses.replace(self.objective, reference=reference)

    def watch_for_hangs(self) -> None:
        """--hang_timeout: this rank's heartbeat, and a watch that ends a stuck run naming the ranks that stopped."""
        if not self.cfg.run.dry_run:
            on_hang = partial(self.ledger.end, HANG_EXIT_CODE)  # the attempt's end in goodput.json
            self.watch = start_hang_watch(self.cfg.hang, self.cfg.run.output_dir, self.dist, on_hang)

    def save(self, now: bool = False) -> Path | None:
        """A checkpoint of this step: committed before this returns (synchronous saves, or `now`: the end of the run,
        a preemption), or (--async_save) taken now, written in the background and committed at a later step
        boundary (commit_pending). Either way a save in flight is committed first: at most one at a time."""
        self.commit_pending(wait=True)
        facts, adapter_only = self.resolved.model_facts, self.cfg.peft.use_peft  # LoRA: the base is not saved
        n_params, n_tensors = checkpoint_parameters(self.engine.module, adapter_only)
        if not adapter_only:
            n_params = self.resolved.n_params  # the whole model (a pipeline stage's module holds its layers alone)
        if facts and facts.get("base") and facts["base"]["weights"] is None:  # a hub base first downloaded by this run
            facts["base"] = base_identity(facts["base"]["source"])
        planned = planned_checkpoint_bytes(
            n_params,
            self.resolved.ds.precision,
            self.resolved.ds.zero_stage,
            self.dist.tensor_parallel_size,
            n_tensors,
            self.dist.world_size,
        )
        out, rank = self.cfg.run.output_dir, self.dist.rank
        if self.writer is not None and not now:
            start_checkpoint(self.engine, out, self.state, rank, self.writer, model_facts=facts, planned_bytes=planned)
            self._in_flight_step_s = self.ledger.attempt["step_s"]
            return None
        limit = self.cfg.checkpoint.save_total_limit
        path = save_checkpoint(self.engine, out, self.state, rank, limit, model_facts=facts, planned_bytes=planned)
        self.ledger.committed(self.state.step)
        return path

    def commit_pending(self, wait: bool = False) -> None:
        """--async_save, at a step boundary (every rank): commit the save in flight once every rank's write is done
        (`wait`: this rank's first); a failed write ends the run here."""
        step = self.writer and self.writer.in_flight and self.writer.in_flight.step  # None: nothing in flight
        if step and settle_checkpoint(self.writer, self.dist.rank, self.cfg.checkpoint.save_total_limit, wait):
            self.ledger.committed(step, self._in_flight_step_s)

    def train(self) -> None:
        dry = self.cfg.run.dry_run  # one full step, logged, nothing saved
        settings = loop_settings(self.resolved, self.dist, self.state.step, self.schedule.total_steps, self.objective)
        shard = None
        if self.dist.sequence_parallel_size > 1:  # each rank of a sequence-parallel group keeps its part of a block
            shard = partial(sequence_shard, sp_rank=self.dist.sp_rank, sp=self.dist.sequence_parallel_size)
        batches = StepBatches(self.train_blocks, self.order, self.dist.dp_rank, shard)
        policy = NonFinitePolicy.from_args(self.cfg.nonfinite, fp16=self.resolved.ds.precision == "fp16")
        self.guard = NonFiniteGuard(policy, self.state, self.cfg.run.output_dir, self.dist.is_main, write_files=not dry)
        hooks = LoopHooks(
            metrics=self.metrics,
            save=self.save,
            save_now=partial(self.save, now=True),
            commit_pending=self.commit_pending,
            preemption=self.preemption,
            eval_sets=self.eval_sets,
            profiler=StepProfiler(self.cfg.logging.profile_range, self.cfg.run.output_dir, self.dist.rank),
            guard=self.guard,
            switch=SkipSwitch(self.engine.optimizer) if policy.action == "skip" else None,
            rollback=self.rollback,
            pipeline=self.pipeline_step,
            comm_log=self.comm_log,
            generate=self.generate_samples if self.resolved.eval_prompts else None,
            ledger=self.ledger,
            watch=self.watch,
        )
        train_loop(self.engine, batches, self.state, settings, hooks)

    def generate_samples(self, step: int) -> None:
        """--eval_prompts: every rank generates (ZeRO-3 gathers in each forward); rank 0 records the text."""
        tokenizer = self.resolved.tokenizer
        rows = generate_samples(
            self.engine,
            self.resolved.eval_prompts,
            tokenizer,
            reply_end_ids(tokenizer),
            synced=self.dist.world_size > 1,
        )
        self.metrics.log_generations(step, rows)

    def rollback(self) -> None:
        """--max_consecutive_skips reached: back to the newest committed checkpoint, the data past the streak."""
        self.commit_pending(wait=True)  # a save in flight is committed first: it may be the one to go back to
        resharded = self.resolved.resume_from if self.resolved.reshard else None
        roll_back(
            self.engine,
            self.state,
            self.cfg.run.output_dir,
            self.dist,
            resharded,
            self._reloaded,
            self.metrics,
            self.guard,
            self.cfg.nonfinite.max_consecutive_skips,
        )

    def _reloaded(self, universal: bool) -> None:
        """After a checkpoint was loaded (resume, rollback): this run's flags rule from here on. A universal load
        restores no weight decay and (ZeRO-3) shares one Adam step counter: repaired here. The checkpoint restored the
        saving run's peak LR and next LR."""
        if universal:
            repair_universal_load(self.engine, self.cfg.optim.weight_decay)
        restart_schedule(self.engine.lr_scheduler, self.schedule, peak_lr(self.resolved.ds))
        self._record_layout()

    def finish(self) -> None:
        if self.cfg.run.dry_run:
            log.info(describe_dry_run(self.metrics.last_record or {}))
            return
        if self.watch is not None:
            self.watch.phase("end of run: evaluation, save, export", long=True)
        self.commit_pending(wait=True)  # --async_save: the save in flight is committed before anything else
        # Decided once, by rank 0: ranks that disagreed about entering a collective save or evaluation would hang in
        # it. A run resumed at its last step (already complete) has evaluated it: its records are not repeated.
        step = self.state.step
        newest, evaluated = broadcast_from_main(
            (newest_committed(self.cfg.run.output_dir), self.metrics.evaluated(step)) if self.dist.is_main else None
        )
        if self.eval_sets and not evaluated:
            evaluator = self.pipeline_step or self.objective
            self.metrics.log({"step": step, **evaluate_sets(self.engine, self.eval_sets, evaluator)})
        if self.resolved.eval_prompts and not evaluated:
            self.generate_samples(step)
        if self.cfg.checkpoint.save_at_end and (newest is None or committed_step(newest) != self.state.step):
            self.save(now=True)
        if self.cfg.checkpoint.export_hf_at_end:
            export_hf_model(
                self.engine,
                self.resolved.tokenizer,
                self.cfg.run.output_dir,
                self.dist.is_main,
                self.cfg.peft.merge_lora,
                self.cfg.model.trust_remote_code,
            )
            if self.dist.is_main:  # generation config and model card: the folder is complete and publishable
                out, merged = self.cfg.run.output_dir, self.cfg.peft.merge_lora
                run_config = json.loads((Path(out) / RUN_CONFIG_FILE).read_text())
                for folder in (out, *([merged_dir(out)] if merged else [])):
                    complete_export(
                        folder, self.resolved.tokenizer, self.resolved.model_config, run_config, self.metrics.latest
                    )
        if self.comm_log is not None:  # every rank's totals, gathered: a slow link shows
            log.info(comms_summary(all_gather_objects(self.comm_log.totals())))
        log.info(
            "done: %d steps, %d tokens trained; outputs in %s",
            self.state.step,
            self.state.tokens_seen,
            self.cfg.run.output_dir,
        )

    def publish(self) -> int:
        """--push_to_hub: rank 0 uploads the export (after close(): outside any collective); the exit code."""
        repo = self.cfg.checkpoint.push_to_hub
        if not repo or not self.dist.is_main or self.cfg.run.dry_run:
            return 0
        return publish_export(self.cfg.run.output_dir, repo, self.cfg.checkpoint.hub_private_repo)

    def close(self, exit_code: int = 0) -> None:
        """Free everything the run holds, on the error path too; `exit_code` (the process's) goes to wandb."""
        self.preemption.uninstall()
        if self.writer is not None:  # a write still in flight here (a crash) is never committed
            self.writer.close()
            self.writer = None
        if self.watch is not None:
            self.watch.stop()
        if self.comm_log is not None:
            self.comm_log.close()
            self.comm_log = None
        self.ledger.end(exit_code, self.metrics)
        if self.metrics is not None:
            self.metrics.close(exit_code)
        if self._shm_allreduce is not None:
            log.info(
                "cpu: %d all-reduces (%.2f GB) went through shared memory",
                self._shm_allreduce.calls,
                self._shm_allreduce.bytes / 1e9,
            )
            self._shm_allreduce.uninstall()
            self._shm_allreduce = None
        # The engine, optimizer and ZeRO-3 parameters hold process groups, so destroy_process_group alone left
        # gloo's threads running until the interpreter tore the objects down at exit, which now and then aborted
        # a finished run (SIGABRT, "terminate called without an active exception"). Free them here instead.
        if self.engine is not None:
            try:
                release_engine(self.engine)
            except Exception as err:  # never hide the error that brought us here, nor skip the teardown
                log.warning("could not release the DeepSpeed engine cleanly: %s", err)
        if self.objective is not None and self.objective.reference is not None:  # a live reference's own engine
            release_engine(self.objective.reference)
        self.engine = self.model = self._zero3_keepalive = self.guard = self.pipeline_step = self.objective = None
        teardown_distributed(self.dist.rank)
        lingering = communication_threads()
        if lingering:
            log.warning(
                "%d communication threads outlive the process group: something still holds it, and the "
                "interpreter will tear it down at exit",
                lingering,
            )
