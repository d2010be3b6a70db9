"""One checkpoint save: what every rank writes (DeepSpeed's shards, its RNG state, rank 0's train state and a
pipeline's layer map), in the order of the commit protocol (commit.py) with its disk-space check and its handling
of a failed write; and the size a checkpoint is planned to take before the first one exists."""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from scaletrain.checkpoint.commit import (
    CHECKPOINT_DIR,
    COMMIT,
    LATEST,
    PREFIX,
    TMP_PREFIX,
    commit_checkpoint,
    committed_step,
    committed_step_key,
    describe_write_failure,
    file_checksum,
    is_write_failure,
    sync_to_disk,
)
from scaletrain.checkpoint.async_save import BackgroundWriter, InFlight
from scaletrain.distributed import LAYER_MAP
from scaletrain.errors import CheckpointWriteError
from scaletrain.train import TrainState
from scaletrain.parts import DistInfo

log = logging.getLogger(__name__)
# The first save's planned size (planned_checkpoint_bytes) must fit with this margin: the plan is within 3% of the
# tests' checkpoints (a 37K-parameter LoRA adapter, where fixed costs are a sixth to a third of the bytes, included).
FIRST_SAVE_MARGIN = 1.05
# torch.save's zip record per tensor measures 0.66-0.78 KB (the LoRA test's 56 tensors); a file's own pickled fields
# (config, LR schedule, shapes) 2-8 KB.
TENSOR_RECORD_BYTES = 1024
FILE_BYTES = 8192


def _rng_state() -> dict:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def planned_checkpoint_bytes(
    n_params: int,
    *,
    precision: str,
    zero_stage: int,
    tensor_parallel_size: int = 1,
    n_tensors: int = 0,
    world_size: int = 1,
) -> int:
    """The size of a checkpoint before the first one exists: fp32 master weights and Adam moments (12 bytes a
    parameter) plus the module's weights in the training dtype (not under ZeRO-3, whose model files hold
    placeholders), counted whole per tensor-parallel rank since each writes its own model file (the tiny Llama at TP 2
    writes 1.30x the plain estimate; this counts 1.31x with the margin). n_params and n_tensors count what the
    checkpoint holds (a LoRA model's trainable parameters alone); the fixed costs per tensor and file matter only for
    a small adapter (the test's 37K-parameter one: 0.60 MB for 0.45 MB of states)."""
    from scaletrain.observability import OPTIMIZER_BYTES, weight_bytes

    weights = 0 if zero_stage == 3 else weight_bytes(precision) * tensor_parallel_size
    model_files = world_size if zero_stage == 3 else tensor_parallel_size
    fixed = model_files * (TENSOR_RECORD_BYTES * n_tensors + FILE_BYTES) + world_size * (FILE_BYTES + _rng_bytes())
    return n_params * (OPTIMIZER_BYTES + weights) + fixed


def _rng_bytes() -> int:
    """The size of one rank's RNG state file (the same states on every rank: their sizes do not differ)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(_rng_state(), buffer)
    return buffer.getbuffer().nbytes


def checkpoint_parameters(module, adapter_only: bool) -> tuple:
    """(parameters, tensors) that a checkpoint of `module` holds: with adapter_only (LoRA) the trainable ones alone;
    ZeRO-3 partitions are counted at their full size."""
    params = [p for p in module.parameters() if p.requires_grad or not adapter_only]
    return sum(getattr(p, "ds_numel", p.numel()) for p in params), len(params)


def _last_committed_size(root: Path) -> tuple:
    """(newest checkpoint with a commit record, its bytes): the size the next save will need again."""
    if not root.is_dir():
        return None, 0
    committed = (p for p in root.iterdir() if committed_step(p) is not None)
    for ckpt in sorted(committed, key=committed_step_key, reverse=True):
        try:
            return ckpt, sum(json.loads((ckpt / COMMIT).read_text())["files"].values())
        except (OSError, ValueError, KeyError):
            continue
    return None, 0


def _intact(previous: Path | None) -> str:
    return (
        f"the previous committed checkpoint {previous} is intact and a restart resumes from it"
        if previous
        else "no checkpoint of this run was committed yet"
    )


@dataclass(frozen=True)
class CheckpointContents:
    """What a checkpoint records besides DeepSpeed's shards: the train state, the state of the parts that carry their
    own (the non-finite guard's running mean, the wandb run id), and the model's facts."""

    state: TrainState
    carried: dict  # each carrying part's state_dict(), merged: saved beside the train state's keys
    model_facts: dict | None = None

    @property
    def step(self) -> int:
        return self.state.step

    def train_state(self) -> dict:
        """The train state as the client state and train_state.json keep it, with the carried parts' keys."""
        return {**self.state.state_dict(), **self.carried}


def save_checkpoint(
    engine, *, output_dir: str, contents: CheckpointContents, rank: int, planned_bytes: int = 0
) -> Path:
    """Save and commit checkpoint stepN on every rank; returns its path. The ranks first agree that the disk has room
    for another checkpoint the size of the last (the first: `planned_bytes` x FIRST_SAVE_MARGIN), so a full disk stops
    the run before anything is written; a write that fails later stops every rank the same way."""
    from scaletrain.distributed import barrier

    started = time.perf_counter()
    step = contents.step
    tmp, previous = _begin_save(output_dir, step, rank, planned_bytes)
    root, tag = tmp.parent, f"{PREFIX}{step}"
    deepspeeds, own, failed = _write_checkpoint_files(engine, tmp=tmp, contents=contents, rank=rank)
    checksums, hashed = _gather_checksums(
        tmp, tag=tag, written=deepspeeds + own, failed=failed, rank=rank, previous=previous
    )
    final = root / tag
    hashed += _commit_on_rank0(tmp, final=final, step=step, checksums=checksums, rank=rank, previous=previous)
    barrier()
    log.info(
        f"saved checkpoint {final} in {time.perf_counter() - started:.2f}s (of which SHA-256 {hashed:.2f}s on rank "
        f"{rank})"
    )
    return final


def _begin_save(output_dir: str, step: int, rank: int, planned_bytes: int) -> tuple:
    """Every rank, at the start of a save of `step`: rank 0 makes the folder and clears unfinished saves, then the
    agreed space check; (the temporary folder, the newest committed checkpoint)."""
    from scaletrain.distributed import barrier

    root = Path(output_dir) / CHECKPOINT_DIR
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _clear_unfinished(root)
    barrier()
    previous = _check_disk_space(root, f"{PREFIX}{step}", planned_bytes)
    return root / f"{TMP_PREFIX}{PREFIX}{step}", previous


def _clear_unfinished(root: Path) -> None:
    """Rank 0, before a save (no other is in flight): the folders of saves that never committed (a kill, a crash with
    a background write in flight) go, with the space they hold."""
    for unfinished in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(unfinished, ignore_errors=True)


def _check_disk_space(root: Path, tag: str, planned_bytes: int) -> Path | None:
    """Every rank: room for another checkpoint of the last one's size (the first: the planned size with its margin),
    agreed by the ranks; a full disk stops them all before anything is written. Returns the newest committed
    checkpoint, which the error messages of the later steps name as the one a restart resumes from."""
    from scaletrain.distributed import any_rank

    previous, needed = _last_committed_size(root)
    what = "the last checkpoint took"
    if previous is None and planned_bytes:
        needed, what = int(planned_bytes * FIRST_SAVE_MARGIN), "the first checkpoint needs about"
    free = shutil.disk_usage(root).free
    if any_rank(free < needed):
        raise CheckpointWriteError(
            f"checkpoint {tag}: not enough disk space in {root} ({free / 1e9:.2f} GB free, {what} "
            f"{needed / 1e9:.2f} GB); nothing was written, {_intact(previous)}. Free space or lower "
            "--save_total_limit, then restart",
            every_rank=True,
        )
    return previous


def _write_checkpoint_files(engine, *, tmp: Path, contents: CheckpointContents, rank: int, write=None) -> tuple:
    """DeepSpeed's shards, then this rank's own files, into the temporary folder: (DeepSpeed's paths, this rank's own
    files, the first failed write as (path, error) or None). A failed write is recorded rather than raised, so that
    this rank still reaches the collectives of DeepSpeed's save and of _gather_checksums with the others. `write`:
    takes DeepSpeed's state dicts instead of writing them (an asynchronous save's snapshot)."""
    from scaletrain.engine import recorded_checkpoint_writes, universal_checkpoint_info

    # universal_checkpoint_info lets DeepSpeed's ds_to_universal convert this checkpoint for another rank count.
    layout = contents.state.layout
    client_state = {
        "train_state": contents.train_state(),
        **universal_checkpoint_info(layout.tp if layout else 1),
    }
    with recorded_checkpoint_writes(engine, is_write_failure, write) as writes:
        engine.save_checkpoint(
            str(tmp.parent),
            tag=tmp.name,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=without_frozen_base(engine),
        )
    deepspeeds, own, failed = [Path(p) for p in writes.paths], [], writes.failed
    if failed is None:
        try:
            own = _write_own_files(engine, tmp=tmp, contents=contents, rank=rank)
        except (OSError, RuntimeError) as err:
            if not is_write_failure(err):
                raise
            failed = (str(tmp), err)
    return deepspeeds, own, failed


def _gather_checksums(tmp: Path, *, tag: str, written: list, failed: tuple | None, rank: int, previous) -> tuple:
    """Hash this rank's files and gather every rank's (checksums, failure): (all checksums by relative path, the
    seconds this rank spent hashing). Any rank's failed write stops every rank; rank 0 removes the folder."""
    from scaletrain.distributed import all_gather_objects

    hashing = time.perf_counter()
    mine = [] if failed else [p for p in written if tmp in p.parents]
    failed, mine = _synced(mine, tmp, failed)  # on disk before any rank reports it written (and the commit names it)
    checksums = {str(p.relative_to(tmp)): file_checksum(p) for p in mine}
    hashed = time.perf_counter() - hashing
    failure = failed and f"rank {rank} could not write {failed[0]} ({describe_write_failure(failed[1], tmp)})"
    # A collective: every rank's files are on disk, and every rank learns whether any write failed.
    reports = all_gather_objects((failure, checksums))
    failures = [f for f, _ in reports if f]
    if failures:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never committed; removed to give the space back
        raise CheckpointWriteError(
            f"checkpoint {tag}: {failures[0]}; it was not committed and its folder was removed, {_intact(previous)}."
            " Free space or lower --save_total_limit, then restart",
            every_rank=True,
        )
    return {k: v for _, sums in reports for k, v in sums.items()}, hashed


def _synced(paths: list, tmp: Path, failed: tuple | None) -> tuple:
    """(the first failed write or None, the files on disk): `paths` fsynced, a failure of it recorded as a failed
    write (a full disk or an I/O error can surface only here), so that this rank still reaches the collectives."""
    if failed is not None:
        return failed, []
    try:
        sync_to_disk(paths)
    except OSError as err:
        return (str(tmp), err), []
    return None, paths


def _commit_on_rank0(tmp: Path, *, final: Path, step: int, checksums: dict, rank: int, previous) -> float:
    """Rank 0 commits the folder (commit_checkpoint) and the ranks agree that it worked, so that none goes on as if
    an uncommitted checkpoint were committed; a stale `latest` alone only warns. Returns rank 0's seconds hashing."""
    from scaletrain.distributed import any_rank

    root = final.parent
    hashed, commit_failure = 0.0, None
    if rank == 0:
        try:
            hashed = commit_checkpoint(tmp, final=final, root=root, step=step, checksums=checksums)
        except OSError as err:
            if (final / COMMIT).is_file():  # renamed with its record: committed, only `latest` is stale
                log.warning(
                    "checkpoint %s is committed, but %s could not be updated (%s); resumes do not read it",
                    final,
                    root / LATEST,
                    describe_write_failure(err, root),
                )
            else:
                commit_failure = describe_write_failure(err, root)
                shutil.rmtree(tmp, ignore_errors=True)
    if any_rank(commit_failure is not None):  # the others must not go on as if it were committed
        raise CheckpointWriteError(
            f"checkpoint {final.name}: committing it failed ({commit_failure}); it was not committed, "
            f"{_intact(previous)}",
            every_rank=True,
        )
    return hashed


def without_frozen_base(engine) -> bool:
    """Whether checkpoints leave the frozen parameters out: a LoRA model's base is rebuilt from --model_name_or_path at
    every start (lora.check_same_base checks it is the same), so the checkpoint holds the adapter and its optimizer
    state alone (0.7 MB against 7.9 MB with the base, for the test's adapter on the tiny Llama)."""
    from scaletrain.model import is_lora_model

    return is_lora_model(engine.module)


def _write_own_files(engine, *, tmp: Path, contents: CheckpointContents, rank: int) -> list:
    """This rank's RNG state, and on rank 0 the train state and a pipeline's layer map; the paths written."""
    import torch

    rng = tmp / f"rng_state_rank{rank}.pt"
    torch.save(_rng_state(), rng)
    written = [rng]
    if rank == 0:
        info = {**contents.train_state(), "model": contents.model_facts or {}}
        (tmp / "train_state.json").write_text(json.dumps(info, indent=2) + "\n")
        written.append(tmp / "train_state.json")
        if hasattr(engine.module, "scaletrain_layers"):  # a pipeline's layer files, by Hugging Face name
            from scaletrain.distributed import layer_map

            (tmp / LAYER_MAP).write_text(json.dumps(layer_map(engine.module), indent=1) + "\n")
            written.append(tmp / LAYER_MAP)
    return written


# --- asynchronous saves (async_save.py): the snapshot on the training path, the commit at a later step boundary ---


def start_checkpoint(
    engine,
    *,
    output_dir: str,
    contents: CheckpointContents,
    rank: int,
    writer: BackgroundWriter,
    planned_bytes: int = 0,
) -> str | None:
    """Every rank: the space check as for save_checkpoint, then DeepSpeed's save with each file's state dict taken
    into this rank's host buffers instead of written, this rank's own small files (RNG and train state) written, and
    the snapshot handed to the writer process. Training goes on; settle_checkpoint commits it later. Where a rank's
    /dev/shm could not hold its buffers, nothing is handed over and every rank returns why (None: started)."""
    from scaletrain.distributed import any_rank

    from scaletrain.checkpoint.async_save import SnapshotBuffersFull

    started = time.perf_counter()
    step = contents.step
    tmp, previous = _begin_save(output_dir, step, rank, planned_bytes)
    tag = f"{PREFIX}{step}"
    snapshot = writer.snapshot()
    _, own, failed = _write_checkpoint_files(engine, tmp=tmp, contents=contents, rank=rank, write=snapshot.take)
    buffers_full = failed is not None and isinstance(failed[1], SnapshotBuffersFull)
    if any_rank(buffers_full):  # every rank gives up the snapshot; the caller saves synchronously (the same folder)
        writer.buffers.release()
        return str(failed[1]) if buffers_full else "another rank's snapshot buffers did not fit"
    failed, own = _synced(own, tmp, failed)  # this rank's small files; the writer syncs the large ones
    if any_rank(failed is not None):  # every rank takes the synchronous failure path: one message, nothing kept
        _gather_checksums(tmp, tag=tag, written=own, failed=failed, rank=rank, previous=previous)
    own_checksums = {str(p.relative_to(tmp)): file_checksum(p) for p in own}
    writer.submit(
        InFlight(tag, tmp=tmp, step=step, previous=previous, own_checksums=own_checksums, started=time.perf_counter()),
        snapshot,
    )
    log.info(
        "checkpoint %s: snapshot taken in %.2fs (%.2f GB of host buffers); written in the background",
        tag,
        time.perf_counter() - started,
        writer.buffers.nbytes / 1e9,
    )
    return None


def settle_checkpoint(writer: BackgroundWriter, rank: int, wait: bool = False) -> Path | None:
    """Every rank, at the same step boundary, while a save is in flight: the ranks agree (one small all-reduce)
    whether every rank's write is done or one failed. Done: the checksums are gathered and rank 0 commits (the
    committed path is returned); failed: every rank raises CheckpointWriteError naming the checkpoint and the cause;
    otherwise None (still writing). `wait`: until this rank's write is done first (a drain)."""
    from scaletrain.distributed import all_gather_objects, max_over_ranks

    flight = writer.in_flight
    if flight is None:
        return None
    status = writer.status(wait=wait)
    if max_over_ranks({"done": 0, "writing": 1, "failed": 2}[status]) == 1:
        return None
    failure = None
    result = flight.result  # the writer's answer, once this rank's write is no longer "writing"
    if status == "failed":
        assert result is not None
        failure = f"rank {rank} could not write {result[1]} ({result[2]})"
    # (a rank still writing when another's write failed sends nothing: nothing is committed)
    checksums = {}
    if status == "done":
        assert result is not None
        checksums = {**flight.own_checksums, **_relative(result[1], flight.tmp)}
    reports = all_gather_objects((failure, checksums))
    writer.in_flight = None
    failures = [f for f, _ in reports if f]
    if failures:
        if rank == 0:
            shutil.rmtree(flight.tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"checkpoint {flight.tag}: {failures[0]}; it was not committed and its folder was removed, "
            f"{_intact(flight.previous)}",
            every_rank=True,
        )
    final = flight.tmp.parent / flight.tag
    _commit_on_rank0(
        flight.tmp,
        final=final,
        step=flight.step,
        checksums={k: v for _, sums in reports for k, v in sums.items()},
        rank=rank,
        previous=flight.previous,
    )
    log.info("committed checkpoint %s, written in the background in %.2fs", final, time.perf_counter() - flight.started)
    return final


def _relative(checksums: dict, tmp: Path) -> dict:
    return {str(Path(path).relative_to(tmp)): digest for path, digest in checksums.items()}


def background_writer(n_params: int, precision: str, zero_stage: int, dist: DistInfo) -> BackgroundWriter | None:
    """--async_save: this rank's writer, unless a host of the run cannot hold the snapshot buffers (then every rank
    saves synchronously, since saves are collectives). Its process starts at the first background save, so its second
    or two of importing torch overlaps training rather than slowing the rank's own start."""
    refusal = snapshot_buffers_refusal(n_params, precision, zero_stage, dist)
    if refusal is not None:
        if dist.local_rank == 0:
            log.warning("--async_save: %s; saves are synchronous", refusal)
        return None
    return BackgroundWriter(dist.rank)


def snapshot_buffers_refusal(n_params: int, precision: str, zero_stage: int, dist: DistInfo) -> str | None:
    """Every rank (a collective): why some host of the run cannot hold its ranks' snapshot buffers now (this host's
    reason where it is one of them), or None. Asked at the start, and again before the first snapshot, when the
    optimizer's states (made at the first step) and the gradients hold their memory too."""
    import os

    from scaletrain.checkpoint.async_save import snapshot_refusal
    from scaletrain.distributed import any_rank
    from scaletrain.observability import snapshot_bytes_per_rank

    per_rank = snapshot_bytes_per_rank(n_params, precision, zero_stage, dist.world_size)
    refusal = snapshot_refusal(per_rank, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1))))
    if any_rank(refusal is not None):
        return refusal or "another host cannot hold its buffers"
    return None
