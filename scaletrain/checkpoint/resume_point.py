"""Which checkpoint a run continues, decided before anything is built: the one --resume_from_checkpoint names (or the
newest committed one), checked against this run's model, layout, ZeRO setting and peak LR, and whether it loads
through DeepSpeed's universal form. A damaged checkpoint found later falls back to the one before it through
resume_elsewhere, which checks the fallback the same way; verify_resume is that later check, by every rank together."""

from __future__ import annotations

from pathlib import Path

from scaletrain.checkpoint.commit import verified_resume_checkpoint
from scaletrain.checkpoint.resume import (
    check_resumable,
    ensure_universal,
    read_train_state,
    resolve_resume,
    saved_zero_stage,
)
from scaletrain.checkpoint.run_folder import read_previous_run_config
from scaletrain.config import DSKey, ResolvedDSConfig, RunConfig, assemble_ds_config
from scaletrain.errors import UsageError
from scaletrain.parts import DistInfo, ParallelLayout, ResumePoint

UNIVERSAL_KEY = "checkpoint.load_universal"


def plan_resume(
    cfg: RunConfig, ds: ResolvedDSConfig, model_facts: dict, layout: ParallelLayout
) -> tuple[ResumePoint | None, tuple[DSKey, ...]]:
    """(the checkpoint this run continues or None, the keys the DeepSpeed config needs to load it)."""
    if cfg.planning.plan:
        return None, ()
    checkpoint = resolve_resume(cfg.checkpoint.resume_from_checkpoint, cfg.run.output_dir)
    if checkpoint is None:
        return None, ()
    return resume_point(cfg, ds=ds, model_facts=model_facts, layout=layout, checkpoint=checkpoint)


def verify_resume(
    resume: ResumePoint | None, *, cfg: RunConfig, ds: ResolvedDSConfig, model_facts: dict | None, dist: DistInfo
) -> tuple[ResumePoint | None, ResolvedDSConfig]:
    """Every rank, once the process group is up: the planned checkpoint's files checked against their SHA-256 (a
    share each) before anything reads them; a damaged one falls back, on every rank, to the previous committed
    checkpoint (or stops the run). Then a checkpoint from another number of ranks, layout or offload is converted to
    DeepSpeed's universal format (global rank 0 converts; the others wait on the file system, with a way out if rank 0
    fails). (the checkpoint the run continues, the DeepSpeed config that loads it)."""
    if resume is None:
        return None, ds
    auto = cfg.checkpoint.resume_from_checkpoint == "auto"
    verified = verified_resume_checkpoint(resume.checkpoint, auto, dist.rank, dist.world_size)
    if verified != resume.checkpoint:
        assert model_facts is not None  # the pre-flight that planned the resume described the model
        resume, ds = resume_elsewhere(verified, cfg=cfg, ds=ds, model_facts=model_facts, layout=dist.layout)
    if resume.reshard:
        ensure_universal(resume.checkpoint, dist.rank)
    return resume, ds


def resume_elsewhere(
    checkpoint: Path, *, cfg: RunConfig, ds: ResolvedDSConfig, model_facts: dict, layout: ParallelLayout
) -> tuple[ResumePoint, ResolvedDSConfig]:
    """(the resume point, the DeepSpeed config) of continuing `checkpoint` instead (the fallback from a damaged
    one), checked as the pre-flight checks its choice; `ds` is the config that loaded the first choice."""
    ds = ds.without(UNIVERSAL_KEY)  # the first choice's resume keys out; `checkpoint`'s in
    resume, keys = resume_point(cfg, ds=ds, model_facts=model_facts, layout=layout, checkpoint=checkpoint)
    return resume, assemble_ds_config(ds, keys)


def resume_point(
    cfg: RunConfig, *, ds: ResolvedDSConfig, model_facts: dict, layout: ParallelLayout, checkpoint: Path
) -> tuple[ResumePoint, tuple[DSKey, ...]]:
    previous = read_previous_run_config(checkpoint)
    check_peak_lr(cfg, ds, previous, checkpoint)
    reshard = check_resumable(
        checkpoint, layout=layout, zero_stage=ds.zero_stage, offload=ds.offload_setting, model_facts=model_facts
    )
    state = read_train_state(checkpoint)
    point = ResumePoint(checkpoint, state, reshard, previous)
    if not reshard:
        return point, ()
    saved = tuple(state.get(f"{kind}_parallel_size", 1) for kind in ("tensor", "sequence", "pipeline"))
    why = (
        f"resume of a checkpoint from {state['world_size']} data-parallel ranks x (tensor, sequence, "
        f"pipeline) parallel {saved} on {layout.dp} x ({layout.tp}, {layout.sp}, {layout.pp}), ZeRO stage "
        f"{saved_zero_stage(checkpoint, state)} ({state.get('offload') or 'offload unrecorded'}) "
        f"on {ds.zero_stage} ({ds.offload_setting})"
    )
    return point, (DSKey(UNIVERSAL_KEY, True, why),)


def check_peak_lr(cfg: RunConfig, ds: ResolvedDSConfig, previous: dict | None, checkpoint: Path) -> None:
    """A resumed run restarts its schedule from its own peak LR; another peak than the run it continues is refused
    unless asked for."""
    old, new = (previous or {}).get("peak_lr"), ds.peak_lr
    if old is None or old == new or cfg.checkpoint.allow_schedule_change:
        return
    flag = (
        "--learning_rate"
        if ds.sources.get("optimizer.params.lr") == "--learning_rate"
        else f"optimizer.params.lr in {cfg.engine.config}"
    )
    raise UsageError(
        f"{flag} {new}: the run resumed from {checkpoint} trained with a peak LR of {old}",
        f"use {flag} {old} to continue it, or add --allow_schedule_change to resume with the new peak",
    )
