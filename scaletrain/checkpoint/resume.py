"""Resuming a run: which checkpoint (resolve_resume), whether it fits this run (check_resumable: the model, the
parallel layout, ZeRO-setting changes, pipeline stages to data parallelism), its conversion to a universal checkpoint
when it must be resharded (ensure_universal: global rank 0 converts, the others wait on its markers), and the load
itself (load_checkpoint: the engine's states, the train state, this rank's RNG)."""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from pathlib import Path

from scaletrain.checkpoint.commit import newest_committed, universal_path, verify, write_atomically
from scaletrain.checkpoint.save import without_frozen_base
from scaletrain.distributed import LAYER_MAP
from scaletrain.errors import UsageError
from scaletrain.model import check_same_base
from scaletrain.parts import ParallelLayout
from scaletrain.train import TrainState

log = logging.getLogger(__name__)


def resolve_resume(value: str, output_dir: str) -> Path | None:
    """--resume_from_checkpoint: auto (newest committed in --output_dir, if any), none, or a checkpoint path."""
    if value == "none":
        return None
    if value == "auto":
        return newest_committed(output_dir)
    ckpt = Path(value)
    if not ckpt.is_dir():
        raise UsageError(
            f"--resume_from_checkpoint {value}: no such folder",
            "give a checkpoint folder (checkpoints/stepN), auto or none",
        )
    problem = verify(ckpt)
    if problem:
        raise UsageError(
            f"--resume_from_checkpoint {value}: not a committed checkpoint ({problem})",
            "use another checkpoint, or auto to take the newest good one",
        )
    return ckpt


def read_train_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "train_state.json").read_text())


def saved_zero_stage(ckpt: Path, saved: dict) -> int | None:
    """The ZeRO stage a checkpoint was saved with: recorded in its train state, or (older checkpoints) read from its
    file names: ZeRO-3 writes each rank's model states, ZeRO-1/2 one model file and each rank's optimizer states,
    stage 0 neither. 1 stands for "1 or 2" there: the two load each other's checkpoints directly."""
    if saved.get("zero_stage") is not None:
        return saved["zero_stage"]
    if any(ckpt.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")):
        return 3
    return 1 if any(ckpt.glob("*zero_pp_rank_*optim_states.pt")) else None


def zero_setting_change(ckpt: Path, saved: dict, zero_stage: int, offload: str | None) -> str | None:
    """Why the checkpoint must go through a universal checkpoint for this run's ZeRO settings, or None.

    DeepSpeed 0.19.8 loads ZeRO-1 and ZeRO-2 checkpoints into each other directly (same optimizer, same partition
    files; tested exact), but not one into another offload setting (a KeyError: DeepSpeedCPUAdam's parameter groups
    are not torch AdamW's): that goes through a universal checkpoint (each parameter's fp32 weights and moments by
    name), tested exact for ZeRO-2. Under ZeRO-3 the same conversion loads but the losses drift from the
    uninterrupted run's (7e-4 relative within 4 steps), so an offload change is refused there. ZeRO-1/2 <-> ZeRO-3
    is refused: its loader asserts on the other stage's model files, and even with them renamed, the universal
    optimizer state that stages 1/2 write is not the one stage 3 reads (KeyError 'optimizer_state_dict').
    Stage 0 (no ZeRO partitions) converts neither way."""
    before = saved_zero_stage(ckpt, saved)
    if before is None and zero_stage == 0:
        return None
    if (before == 0 or before is None) != (zero_stage == 0):
        raise UsageError(
            f"checkpoint {ckpt} was saved with ZeRO stage {0 if before is None else before}, this run has stage "
            f"{zero_stage}: a checkpoint converts between ZeRO stages 1-3 only (stage 0 holds no ZeRO partitions)",
            f"resume with a ZeRO stage {0 if before is None else before} config",
        )
    if zero_stage == 0:
        return None
    if (before == 3) != (zero_stage == 3):  # DeepSpeed's universal optimizer files differ between the two as well
        raise UsageError(
            f"checkpoint {ckpt} was saved with ZeRO stage {before if before == 3 else '1 or 2'}, this run has stage "
            f"{zero_stage}: DeepSpeed 0.19.8 converts a checkpoint between ZeRO-1/2 and ZeRO-3 in neither form (its "
            "loader asserts on the other stage's files, and the universal optimizer state of stages 1/2 is not the "
            "one stage 3 reads)",
            f"resume with a stage-{before if before == 3 else '1/2'} config (offload may change), or export the "
            "weights (scripts/export_hf.py) and start from them with --model_name_or_path",
        )
    if saved.get("offload") not in (None, offload):
        if zero_stage == 3:  # converted and loaded, but the losses left the uninterrupted run's (7e-4 in 4 steps)
            raise UsageError(
                f"checkpoint {ckpt} was saved under ZeRO-3 with {saved['offload']}, this run has {offload}: a ZeRO-3 "
                "checkpoint does not resume exactly under another offload setting (tested: the losses drift)",
                f"resume with the offload of the saving run ({saved['offload']})",
            )
        return f"offload {saved['offload']} -> {offload}"
    return None


def check_resumable(ckpt: Path, *, layout: ParallelLayout, zero_stage: int, offload: str, model_facts: dict) -> bool:
    """Before anything is built: the checkpoint fits this run's model. Returns whether it must be resharded (saved
    with another number of data-parallel ranks or another (tensor, sequence) parallel layout, or under ZeRO settings
    this run's cannot load directly (zero_setting_change), which ZeRO-1/2/3 handle through a universal checkpoint).
    A pipeline checkpoint resumes on the same pipeline layout, or (ZeRO-1) without pipeline parallelism, on any
    number of data-parallel ranks (with its tensor size, or none), through a universal checkpoint renamed to the
    model's names."""
    saved = read_train_state(ckpt)
    saved_pp = saved.get("pipeline_parallel_size", 1)
    tp_sp = (layout.tp, layout.sp)
    _check_tensor_stages_change(ckpt, saved, layout)
    if saved_pp != layout.pp:
        _check_pipeline_change(ckpt, saved, layout, zero_stage)
    if layout.pp > 1 and saved.get("world_size") not in (None, 0, layout.dp):
        raise UsageError(
            f"checkpoint {ckpt} was saved with {saved['world_size']} data-parallel ranks per pipeline stage, this "
            f"run has {layout.dp}: a pipeline checkpoint resumes on the same layout only",
            f"launch {saved['world_size'] * layout.pp} ranks",
        )
    saved_dp = saved.get("world_size")
    saved_layout = (saved.get("tensor_parallel_size", 1), saved.get("sequence_parallel_size", 1))
    reshard = saved_dp not in (None, 0, layout.dp) or saved_layout != tp_sp or saved_pp != layout.pp
    if zero_setting_change(ckpt, saved, zero_stage, offload) is not None:
        reshard = True
    if reshard and zero_stage == 0:
        raise UsageError(
            f"checkpoint {ckpt} was saved with {saved_dp} data-parallel ranks x (tensor, sequence) parallel "
            f"{saved_layout}, this run has {layout.dp} x {tp_sp}",
            "resume with the same layout, or use a ZeRO config (stage 1-3 checkpoints are resharded)",
        )
    before = saved.get("model") or {}
    check_same_base(ckpt, before.get("base"), model_facts.get("base"))  # a LoRA checkpoint carries no base
    differs = [k for k in model_facts if k in before and k != "base" and before[k] != model_facts[k]]
    if differs:
        detail = ", ".join(f"{k} {before[k]} -> {model_facts[k]}" for k in differs)
        raise UsageError(
            f"checkpoint {ckpt} is from a different model ({detail})",
            "resume with the model it was trained with, or start fresh with --resume_from_checkpoint none",
        )
    return reshard


def _check_tensor_stages_change(ckpt: Path, saved: dict, layout: ParallelLayout) -> None:
    """A checkpoint of tensor x pipeline parallelism (each stage's layers split over the tensor ranks) resumes on the
    same layout, or without pipeline parallelism on its tensor size or on none (through the universal checkpoint,
    with every stage's split recorded: ds_internals.merge_stage_universal_info); and no checkpoint becomes tensor x
    pipeline parallel by a change of layout."""
    saved_tp, saved_pp = saved.get("tensor_parallel_size", 1), saved.get("pipeline_parallel_size", 1)
    if (saved_tp, saved_pp) == (layout.tp, layout.pp):
        return
    if layout.pp > 1 and (layout.tp > 1 or saved_tp > 1):
        raise UsageError(
            f"checkpoint {ckpt} was saved with tensor parallel {saved_tp} x pipeline parallel {saved_pp}, this run "
            f"has tensor parallel {layout.tp} x pipeline parallel {layout.pp}: with tensor parallelism a pipeline "
            "checkpoint resumes on its own layout, or without pipeline parallelism",
            f"resume with --tensor_parallel_size {saved_tp} --pipeline_parallel_size {saved_pp}, or export the "
            "checkpoint (scripts/export_hf.py) and train on from the export",
        )
    if saved_tp > 1 and saved_pp > 1 and not saved.get("stage_splits_recorded"):
        raise UsageError(
            f"checkpoint {ckpt} (tensor parallel {saved_tp} x pipeline parallel {saved_pp}) was saved by an earlier "
            "version that recorded only the first stage's tensor split, so it cannot be converted to another layout",
            f"resume with --tensor_parallel_size {saved_tp} --pipeline_parallel_size {saved_pp} (its next checkpoints "
            "convert), or export it (scripts/export_hf.py) and train on from the export",
        )


def _check_pipeline_change(ckpt: Path, saved: dict, layout: ParallelLayout, zero_stage: int) -> None:
    """Pipeline stages -> data parallelism (with the checkpoint's tensor size, or none) is the one change of
    pipeline layout supported."""
    saved_tp, saved_pp = saved.get("tensor_parallel_size", 1), saved.get("pipeline_parallel_size", 1)
    if layout.pp > 1 or layout.sp > 1 or layout.tp not in (1, saved_tp):
        now = (
            f"--pipeline_parallel_size {layout.pp}"
            if layout.pp > 1
            else f"(tensor, sequence) parallel {layout.tp, layout.sp}"
        )
        targets = "plain data parallelism" + (
            f", or tensor parallel {saved_tp} x data parallel" if saved_tp > 1 else ""
        )
        raise UsageError(
            f"checkpoint {ckpt} was saved with tensor parallel {saved_tp} x pipeline parallel {saved_pp}, this run "
            f"has {now}: a change of pipeline layout is supported only from pipeline stages to {targets}",
            f"resume with --pipeline_parallel_size {saved_pp}, or without --pipeline_parallel_size and "
            f"--sequence_parallel_size" + (f" (--tensor_parallel_size {saved_tp} or 1)" if saved_tp > 1 else ""),
        )
    if zero_stage == 0 or not any(ckpt.glob("zero_pp_rank_*_optim_states.pt")):
        raise UsageError(
            f"checkpoint {ckpt} (--pipeline_parallel_size {saved_pp}) resumes without pipeline parallelism only "
            "from ZeRO-1 and with a ZeRO config (its optimizer state is converted to a universal checkpoint)",
            f"resume with --pipeline_parallel_size {saved_pp}, or export it (scripts/export_hf.py)",
        )


def ensure_universal(ckpt: Path, rank: int) -> Path:
    """Convert `ckpt` with DeepSpeed's ds_to_universal once (global rank 0; the others wait for its done-marker).

    Every way the wait can end is marked: rank 0 writes a failure marker when the conversion fails, and holds a
    lock while it converts, which the waiters probe (a rank 0 killed by the out-of-memory killer releases it). A
    barrier (the process group is up) orders rank 0's removal of an earlier attempt's markers, and its taking the
    lock, before any rank looks."""
    import fcntl

    from scaletrain.distributed import barrier
    from scaletrain.engine import universal_conversion_command

    out = universal_path(ckpt)
    done, failed, lock_path = (out.parent / f"{ckpt.name}.{kind}" for kind in ("done", "failed", "lock"))
    command = universal_conversion_command(ckpt, out)  # on every rank: a missing converter stops them all at once
    lock = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        failed.unlink(missing_ok=True)
        lock = open(lock_path, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    barrier()
    if rank == 0:
        assert lock is not None  # taken above, on rank 0
        try:
            if not done.exists():
                _convert_to_universal(ckpt, out, command, done)
        except BaseException as err:
            write_atomically(failed, json.dumps({"error": str(err) or type(err).__name__}) + "\n")
            raise
        finally:
            lock.close()
        return out
    _wait_for_conversion(ckpt, done, failed, lock_path)
    return out


def _convert_to_universal(ckpt: Path, out: Path, command: list, done: Path) -> None:
    import subprocess

    from scaletrain.errors import UniversalConversionFailed

    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(command, capture_output=True, text=True, check=False)  # its output goes in our error
    if proc.returncode != 0:
        raise UniversalConversionFailed(
            f"converting {ckpt} to a universal checkpoint failed (DeepSpeed's ds_to_universal exited "
            f"{proc.returncode}); nothing was trained:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    if (ckpt / LAYER_MAP).exists():  # parameters named by pipeline layer: give them the model's names
        from scaletrain.distributed import rename_universal_parameters

        rename_universal_parameters(out, json.loads((ckpt / LAYER_MAP).read_text()))
    write_atomically(done, "ok\n")
    log.info(
        "converted %s to a universal checkpoint (another rank count, layout or offload) in %.1fs",
        ckpt,
        time.perf_counter() - started,
    )


def _held(lock_path: Path) -> bool:
    """Whether some process holds the lock (a probe: taken and released at once when free)."""
    import fcntl

    try:
        with open(lock_path) as probe:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False  # closing the file releases it
    except BlockingIOError:
        return True
    except FileNotFoundError:
        return False


def _wait_for_conversion(ckpt: Path, done: Path, failed: Path, lock_path: Path) -> None:
    from scaletrain.errors import UniversalConversionFailed

    what = f"global rank 0's conversion of {ckpt} to a universal checkpoint"
    waited = 0.0
    while not done.exists():
        held = _held(lock_path)
        if failed.exists():
            try:
                reason = json.loads(failed.read_text())["error"].splitlines()[0]
            except (OSError, ValueError, KeyError, IndexError):
                reason = "see global rank 0's output"
            raise UniversalConversionFailed(f"waited for {what}: it failed ({reason})", waited=True)
        if not held and not done.exists():  # rank 0 let go of the lock with neither marker: it was killed
            raise UniversalConversionFailed(
                f"waited for {what}: rank 0 ended without finishing it (killed? out of "
                "memory?); see its node's log, then restart",
                waited=True,
            )
        time.sleep(1.0)
        waited += 1.0
        if waited % 300 == 0:
            log.warning("still waiting for %s (%.0f min)", what, waited / 60)


def load_checkpoint(engine, ckpt: Path, state: TrainState, rank: int, universal: bool = False) -> dict:
    """Restore model, optimizer, LR schedule, loss scaler, the train state and this rank's RNG; the saved train state
    (with the keys of the parts that carry their own state, which the checkpoint manager hands them).

    universal: the checkpoint came from another number of ranks and is read from its universal conversion
    (the engine was configured with checkpoint.load_universal); RNG states do not map across rank counts.
    """
    import torch

    from scaletrain.model import load_adapter_state

    started = time.perf_counter()
    source = universal_path(ckpt) if universal else ckpt
    # A LoRA checkpoint lacks the frozen base (save_checkpoint): the built base stays, the rest must fit exactly.
    path, client = engine.load_checkpoint(
        str(source.parent),
        tag=source.name,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        custom_load_fn=load_adapter_state if without_frozen_base(engine) else None,
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt}")
    saved = client["train_state"]
    state.load_state_dict(saved)
    rng = ckpt / f"rng_state_rank{rank}.pt"
    if universal:
        log.info("resharded resume: RNG states start fresh (they do not map to another rank count)")
    elif rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    log.info(
        f"resumed from {ckpt} (step {state.step}, {state.samples_seen} samples seen) in "
        f"{time.perf_counter() - started:.2f}s"
    )
    return saved


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
