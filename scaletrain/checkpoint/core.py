"""Crash-safe checkpoints: a commit protocol over DeepSpeed's sharded save, resume, pruning, and HF export.

Commit protocol (DeepSpeed alone writes its `latest` before its last barrier, so a kill can leave it naming a
half-written checkpoint):
  1. every rank writes its shards, its RNG state and (rank 0) the train state into checkpoints/.tmp-stepN;
     each rank then hashes the files it wrote (SHA-256, read back from the page cache);
  2. the ranks gather (a collective: every file is on disk, and every rank learns whether any write failed); rank 0
     writes commit.json (every file with its size and SHA-256), fsyncs, renames the folder to checkpoints/stepN,
     then replaces checkpoints/latest atomically (temporary file, fsync, rename); the ranks agree that it worked;
  3. only then are checkpoints beyond --save_total_limit deleted (never the newest).
A write that fails on any rank (a full disk: an OSError, or the RuntimeError of torch's zip writer) stops every
rank with one message; the folder is removed, never committed.
Loading trusts only committed checkpoints whose files match their commit.json; anything else is skipped with a
warning that names it, and the newest good one is used. At load time the ranks also check the files' SHA-256
(verified_resume_checkpoint): a damaged file makes them all fall back to the previous committed checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

from scaletrain.errors import CheckpointWriteError, UsageError
from scaletrain.model.lora import check_same_base
from scaletrain.distributed.pipeline import LAYER_MAP
from scaletrain.train.state import TrainState

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
COMMIT = "commit.json"
PREFIX = "step"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"  # a committed checkpoint whose checksums failed, renamed so that no resume picks it
# SHA-256 through hashlib.file_digest: standard, and the fastest of hashlib's here (1.7 GB/s with the CPU's SHA
# instructions, against 1.2 GB/s for BLAKE2b; BENCHMARKS.md). A checksum catches damage; it is no signature.
CHECKSUM = "sha256"
# The first save has no earlier checkpoint to measure: its planned size (planned_checkpoint_bytes) must fit with
# this margin. Measured against the test suite's checkpoints before the plan counted the fixed costs of each file
# (pickled metadata, RNG states): +0.2% (ZeRO-1/2, 1.8M parameters) to +1.8% (ZeRO-3, 0.3M); counting them, a
# 37K-parameter LoRA adapter's checkpoint (where they are a sixth to a third of the bytes) is within 3% of its plan.
FIRST_SAVE_MARGIN = 1.05
# torch.save writes each tensor as a zip record with its pickled metadata: 0.66 KB (a tensor of ZeRO-1/2's module
# state) to 0.78 KB (a ZeRO-3 placeholder) in a model-states file, measured on the LoRA test's 56 adapter tensors;
# and each file has its own pickled fields (the config, the LR schedule, the shapes: 2-8 KB measured).
TENSOR_RECORD_BYTES = 1024
FILE_BYTES = 8192


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def file_checksum(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, CHECKSUM).hexdigest()


def is_write_failure(err: BaseException) -> bool:
    """An error of writing a file: any OSError (ENOSPC, EDQUOT, EIO), or the RuntimeError torch's zip writer
    raises when the disk fills (torch 2.13: "[enforce fail at inline_container.cc:672] . unexpected pos ...", from
    "basic_ios::clear: iostream error"; it carries no errno)."""
    if isinstance(err, OSError):
        return True
    text = f"{err} {err.__context__ or ''}"
    return isinstance(err, RuntimeError) and any(
        marker in text for marker in ("inline_container", "PytorchStreamWriter", "iostream error", "file write failed")
    )


def describe_write_failure(err: BaseException, folder: Path) -> str:
    """Why a write failed, in a few words, with the free space left."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
        not isinstance(err, OSError) and free is not None and free < 16 * 2**20
    )  # torch's writer gives no errno
    reason = "no space left on device" if full else (getattr(err, "strerror", None) or str(err).splitlines()[0])
    return reason if free is None else f"{reason}, {free / 1e9:.2f} GB free"


def committed_step(path: Path) -> int | None:
    name = path.name
    return int(name[len(PREFIX) :]) if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit() else None


def verify(ckpt: Path) -> str | None:
    """None when `ckpt` is a complete committed checkpoint, else the reason it is not."""
    try:
        commit = json.loads((ckpt / COMMIT).read_text())
    except FileNotFoundError:
        return f"no {COMMIT} (never committed)"
    except (OSError, ValueError) as exc:
        return f"unreadable {COMMIT} ({exc})"
    for rel, size in commit["files"].items():
        path = ckpt / rel
        if not path.is_file():
            return f"missing {rel}"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, {COMMIT} says {size}"
    return None


def newest_committed(output_dir: str) -> Path | None:
    """The newest checkpoint that verifies; newer broken ones are skipped with a warning naming them."""
    root = Path(output_dir) / CHECKPOINT_DIR
    return _newest_intact(root) if root.is_dir() else None


def _newest_intact(root: Path, below: int | None = None) -> Path | None:
    """The newest committed checkpoint in `root` (older than step `below`, when given) that verifies; broken ones
    on the way are skipped with a warning naming them."""
    candidates = sorted(
        (
            p
            for p in root.iterdir()
            if p.is_dir() and committed_step(p) is not None and (below is None or committed_step(p) < below)
        ),
        key=committed_step,
        reverse=True,
    )
    for ckpt in candidates:
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        log.warning("skipping checkpoint %s: %s", ckpt, problem)
    return None


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


def checksum_shares(files: dict, world_size: int) -> list:
    """The files of a commit record ({name: size}) split among the ranks by size, largest first, each to the rank
    with the fewest bytes so far: every file is hashed once, each rank reads about 1/world_size of the bytes."""
    shares, loads = [[] for _ in range(world_size)], [0] * world_size
    for rel, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        least = loads.index(min(loads))
        shares[least].append(rel)
        loads[least] += size
    return shares


def find_damage(ckpt: Path, rank: int, world_size: int) -> str | None:
    """The first file of committed checkpoint `ckpt` whose SHA-256 differs from its commit record, found by any
    rank (a collective: the same answer on every rank); None when all match. Each rank hashes its share
    (checksum_shares), so the whole checkpoint is checked before anything, a universal conversion included, reads
    it. A record from before checksums has sizes only, which verify() has checked: None."""
    from scaletrain.distributed.world import all_gather_objects

    commit = json.loads((ckpt / COMMIT).read_text())
    sums = commit.get(CHECKSUM)
    if sums is None:
        log.info("%s: its %s has no checksums (an older checkpoint): sizes checked only", ckpt, COMMIT)
        return None
    started = time.perf_counter()
    mine = [rel for rel in checksum_shares(commit["files"], world_size)[rank] if rel in sums]
    bad = next((rel for rel in mine if file_checksum(ckpt / rel) != sums[rel]), None)
    found = [rel for rel in all_gather_objects(bad) if rel]
    log.info(
        "checked the SHA-256 of %d of %s's files (%.1f MB) in %.2fs on rank %d",
        len(mine),
        ckpt,
        sum(commit["files"][rel] for rel in mine) / 1e6,
        time.perf_counter() - started,
        rank,
    )
    return found[0] if found else None


def _previous_committed(ckpt: Path) -> Path | None:
    """The newest committed checkpoint older than `ckpt` whose files match their sizes, or None."""
    step = committed_step(ckpt)
    return None if step is None else _newest_intact(ckpt.parent, below=step)


def mark_damaged(ckpt: Path, fallback: Path) -> Path:
    """Rank 0: rename a damaged checkpoint out of the resumable names (kept for inspection, never resumed, pruned or
    counted again), drop any universal conversion of it, and point `latest` at the fallback if it named this one."""
    target = ckpt.parent / f"{DAMAGED_PREFIX}{ckpt.name}"
    n = 1
    while target.exists():
        target, n = ckpt.parent / f"{DAMAGED_PREFIX}{ckpt.name}.{n}", n + 1
    os.replace(ckpt, target)
    shutil.rmtree(universal_path(ckpt), ignore_errors=True)
    (universal_path(ckpt).parent / f"{ckpt.name}.done").unlink(missing_ok=True)
    latest = ckpt.parent / LATEST
    if latest.is_file() and latest.read_text().strip() == ckpt.name:
        _write_atomically(latest, fallback.name + "\n")
    return target


def verified_resume_checkpoint(ckpt: Path, auto: bool, rank: int, world_size: int) -> Path:
    """The checkpoint to resume after every rank checked the SHA-256 of its files (find_damage): `ckpt`, or, when
    it is damaged and was chosen by `auto`, the previous committed checkpoint that checks out (rank 0 chooses it
    and marks the damaged one, mark_damaged; one warning). A damaged checkpoint asked for by path, or one with no
    earlier committed checkpoint, stops every rank with one message (UsageError), the damaged one left in place."""
    from scaletrain.distributed.world import all_gather_objects, barrier

    while True:
        bad = find_damage(ckpt, rank, world_size)
        if bad is None:
            return ckpt
        damage = f"{bad} does not match its {CHECKSUM} in {COMMIT}"
        if not auto:
            raise UsageError(
                f"--resume_from_checkpoint {ckpt}: the checkpoint is damaged: {damage}",
                "resume from an earlier checkpoint of the run, or with auto (the newest good one)",
            )
        fallback = all_gather_objects(str(_previous_committed(ckpt) or "") if rank == 0 else None)[0]
        if not fallback:
            raise UsageError(
                f"checkpoint {ckpt} is damaged: {damage}, and no earlier committed checkpoint is left to fall back to",
                "restore its files from a copy, or start afresh with "
                "--resume_from_checkpoint none --overwrite_output_dir",
            )
        if rank == 0:
            kept = mark_damaged(ckpt, Path(fallback))
            log.warning(
                "checkpoint %s is damaged: %s; falling back to %s (the damaged one is kept as %s, and no "
                "later resume picks it)",
                ckpt,
                damage,
                fallback,
                kept,
            )
        barrier()  # renamed before any rank looks at the folder again
        ckpt = Path(fallback)


def planned_checkpoint_bytes(
    n_params: int,
    precision: str,
    zero_stage: int,
    tensor_parallel_size: int = 1,
    n_tensors: int = 0,
    world_size: int = 1,
) -> int:
    """The size of a checkpoint before the first one exists, as the memory planner counts the states: ZeRO's fp32
    master weights and Adam moments (12 bytes a parameter, partitioned or not) plus the module's weights in the
    training dtype, which ZeRO-3 does not write (its model files hold placeholders). Each tensor-parallel rank
    writes its own model file, the replicated weights included: counted as whole weights per TP rank (an upper
    bound; the tiny Llama at TP 2 writes 1.30x the plain estimate, this counts 1.25x, 1.31x with the margin).

    n_params and n_tensors are the parameters that the checkpoint holds: a LoRA model's trainable ones alone
    (save_checkpoint leaves its frozen base out). Beside the states come fixed costs (TENSOR_RECORD_BYTES,
    FILE_BYTES, each rank's RNG states): nothing for a full model, but a sixth to a third of a small adapter's
    checkpoint (the test's 37K-parameter adapter at 2 ranks: 0.60 MB under ZeRO-3 for 0.45 MB of states)."""
    from scaletrain.observability.memory_planner import OPTIMIZER_BYTES, weight_bytes

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


def read_train_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "train_state.json").read_text())


def _last_committed_size(root: Path) -> tuple:
    """(newest checkpoint with a commit record, its bytes): the size the next save will need again."""
    if not root.is_dir():
        return None, 0
    for ckpt in sorted((p for p in root.iterdir() if committed_step(p) is not None), key=committed_step, reverse=True):
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


def save_checkpoint(
    engine,
    output_dir: str,
    state: TrainState,
    rank: int,
    save_total_limit: int,
    model_facts: dict | None = None,
    planned_bytes: int = 0,
) -> Path:
    """Save and commit checkpoint stepN on every rank; returns its path. See the module docstring.

    Before writing, every rank checks that the file system has room for another checkpoint of the size of the
    last one (the first save: `planned_bytes` x FIRST_SAVE_MARGIN), and the ranks agree: a full disk stops the run
    with a clear error before anything is written. A write that fails later stops every rank the same way.
    """
    from scaletrain.distributed.world import all_gather_objects, any_rank, barrier
    from scaletrain.engine.ds_internals import recorded_checkpoint_writes, universal_checkpoint_info

    root = Path(output_dir) / CHECKPOINT_DIR
    tag = f"{PREFIX}{state.step}"
    tmp = root / f"{TMP_PREFIX}{tag}"
    started = time.perf_counter()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
    barrier()
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
    # universal_checkpoint_info lets DeepSpeed's ds_to_universal convert this checkpoint for another rank count.
    client_state = {"train_state": state.state_dict(), **universal_checkpoint_info(state.tensor_parallel_size)}
    with recorded_checkpoint_writes(engine, is_write_failure) as writes:
        engine.save_checkpoint(
            str(root),
            tag=tmp.name,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=_without_frozen_base(engine),
        )
    written, failed = [Path(p) for p in writes.paths], writes.failed
    if failed is None:
        try:
            ours = _write_own_files(engine, tmp, state, rank, model_facts)
            written += ours
        except (OSError, RuntimeError) as err:
            if not is_write_failure(err):
                raise
            failed = (str(tmp), err)
    hashing = time.perf_counter()
    checksums = {} if failed else {str(p.relative_to(tmp)): file_checksum(p) for p in written if tmp in p.parents}
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
    final = root / tag
    commit_failure = None
    if rank == 0:
        try:
            hashed += _commit(tmp, final, root, state.step, {k: v for _, sums in reports for k, v in sums.items()})
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
            f"checkpoint {tag}: committing it failed ({commit_failure}); it was not committed, {_intact(previous)}",
            every_rank=True,
        )
    if rank == 0:
        prune_checkpoints(root, save_total_limit, keep=final)
        remove_universal_copies(root)
    barrier()
    log.info(
        "saved checkpoint %s in %.2fs (of which SHA-256 %.2fs on rank %d)",
        final,
        time.perf_counter() - started,
        hashed,
        rank,
    )
    return final


def _without_frozen_base(engine) -> bool:
    """Whether checkpoints leave the frozen parameters out: a LoRA model's, whose base is built from
    --model_name_or_path at every start (its identity is in the train state, lora.check_same_base), so that the
    checkpoint holds the adapter and its optimizer state alone. Otherwise ZeRO-1/2 write the base in the module
    state (ZeRO-2 again as "frozen_param_fragments": CPU copies, which on a GPU share no storage with the module's),
    ZeRO-3 each rank's slice: 7.9 MB against 0.7 MB for the test's adapter on the tiny Llama."""
    from scaletrain.model.lora import is_lora_model

    return is_lora_model(engine.module)


def _write_own_files(engine, tmp: Path, state: TrainState, rank: int, model_facts: dict | None) -> list:
    """This rank's RNG state, and on rank 0 the train state and a pipeline's layer map; the paths written."""
    import torch

    rng = tmp / f"rng_state_rank{rank}.pt"
    torch.save(_rng_state(), rng)
    written = [rng]
    if rank == 0:
        info = {**state.state_dict(), "model": model_facts or {}}
        (tmp / "train_state.json").write_text(json.dumps(info, indent=2) + "\n")
        written.append(tmp / "train_state.json")
        if hasattr(engine.module, "scaletrain_layers"):  # a pipeline's layer files, by Hugging Face name
            from scaletrain.distributed.pipeline import layer_map

            (tmp / LAYER_MAP).write_text(json.dumps(layer_map(engine.module), indent=1) + "\n")
            written.append(tmp / LAYER_MAP)
    return written


def _commit(tmp: Path, final: Path, root: Path, step: int, checksums: dict) -> float:
    """Rank 0: commit.json (sizes and SHA-256 of every file; a file no rank recorded, such as DeepSpeed's recovery
    script, is hashed here), the rename to its final name and the `latest` pointer. Returns the seconds hashing."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    started = time.perf_counter()
    sums = {rel: checksums.get(rel) or file_checksum(tmp / rel) for rel in files}
    hashed = time.perf_counter() - started
    _write_atomically(tmp / COMMIT, json.dumps({"step": step, "files": files, CHECKSUM: sums}, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomically(root / LATEST, final.name + "\n")
    return hashed


def clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir without resuming: the old checkpoints and metrics go, so nothing stale resumes."""
    out = Path(output_dir)
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)


def offload_setting(ds) -> str:
    """A run's offload devices as its checkpoints record them: "optimizer=<device>,param=<device>"."""
    zero = ds.config.get("zero_optimization", {})
    return ",".join(
        f"{kind}={zero.get(f'offload_{kind}', {}).get('device') or 'none'}" for kind in ("optimizer", "param")
    )


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


def check_resumable(
    ckpt: Path,
    dp_world_size: int,
    layout: tuple,
    zero_stage: int,
    model_facts: dict,
    pipeline_parallel_size: int = 1,
    offload: str | None = None,
) -> bool:
    """Before anything is built: the checkpoint fits this run's model. Returns whether it must be resharded (saved
    with another number of data-parallel ranks or another (tensor, sequence) parallel layout, or under ZeRO settings
    this run's cannot load directly (zero_setting_change), which ZeRO-1/2/3 handle through a universal checkpoint).
    A pipeline checkpoint resumes on the same pipeline layout, or (ZeRO-1) on plain data parallelism with any
    number of ranks, through a universal checkpoint renamed to the model's names."""
    saved = read_train_state(ckpt)
    saved_pp = saved.get("pipeline_parallel_size", 1)
    if saved_pp != pipeline_parallel_size:
        _check_pipeline_change(ckpt, saved_pp, pipeline_parallel_size, tuple(layout), zero_stage)
    if pipeline_parallel_size > 1 and saved.get("world_size") not in (None, 0, dp_world_size):
        raise UsageError(
            f"checkpoint {ckpt} was saved with {saved['world_size']} data-parallel ranks per pipeline stage, this "
            f"run has {dp_world_size}: a pipeline checkpoint resumes on the same layout only",
            f"launch {saved['world_size'] * pipeline_parallel_size} ranks",
        )
    saved_dp = saved.get("world_size")
    saved_layout = (saved.get("tensor_parallel_size", 1), saved.get("sequence_parallel_size", 1))
    reshard = (
        saved_dp not in (None, 0, dp_world_size) or saved_layout != tuple(layout) or saved_pp != pipeline_parallel_size
    )
    if zero_setting_change(ckpt, saved, zero_stage, offload) is not None:
        reshard = True
    if reshard and zero_stage == 0:
        raise UsageError(
            f"checkpoint {ckpt} was saved with {saved_dp} data-parallel ranks x (tensor, sequence) parallel "
            f"{saved_layout}, this run has {dp_world_size} x {tuple(layout)}",
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


def _check_pipeline_change(ckpt: Path, saved_pp: int, pp: int, layout: tuple, zero_stage: int) -> None:
    """Pipeline stages -> data parallelism is the one change of pipeline layout supported."""
    if pp > 1 or layout != (1, 1):
        now = f"--pipeline_parallel_size {pp}" if pp > 1 else "(tensor, sequence) parallel " + str(layout)
        raise UsageError(
            f"checkpoint {ckpt} was saved with --pipeline_parallel_size {saved_pp}, this run has {now}: a change of "
            "pipeline layout is supported only from pipeline stages to plain data parallelism",
            f"resume with --pipeline_parallel_size {saved_pp}, or without any model-parallel flag",
        )
    if zero_stage == 0 or not any(ckpt.glob("zero_pp_rank_*_optim_states.pt")):
        raise UsageError(
            f"checkpoint {ckpt} (--pipeline_parallel_size {saved_pp}) resumes without pipeline parallelism only "
            "from ZeRO-1 and with a ZeRO config (its optimizer state is converted to a universal checkpoint)",
            f"resume with --pipeline_parallel_size {saved_pp}, or export it (scripts/export_hf.py)",
        )


UNIVERSAL_DIR = ".universal"


def universal_path(ckpt: Path) -> Path:
    return ckpt.parent / UNIVERSAL_DIR / ckpt.name


def ensure_universal(ckpt: Path, rank: int) -> Path:
    """Convert `ckpt` with DeepSpeed's ds_to_universal once (global rank 0; the others wait for its done-marker).

    Every way the wait can end is marked: rank 0 writes a failure marker when the conversion fails, and holds a
    lock while it converts, which the waiters probe (a rank 0 killed by the out-of-memory killer releases it). A
    barrier (the process group is up) orders rank 0's removal of an earlier attempt's markers, and its taking the
    lock, before any rank looks."""
    import fcntl

    from scaletrain.distributed.world import barrier
    from scaletrain.engine.ds_internals import universal_conversion_command

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
        try:
            if not done.exists():
                _convert_to_universal(ckpt, out, command, done)
        except BaseException as err:
            _write_atomically(failed, json.dumps({"error": str(err) or type(err).__name__}) + "\n")
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
        from scaletrain.distributed.pipeline import rename_universal_parameters

        rename_universal_parameters(out, json.loads((ckpt / LAYER_MAP).read_text()))
    _write_atomically(done, "ok\n")
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


def remove_universal_copies(root: Path) -> None:
    """After a commit: a universal copy (as large as its checkpoint) is only read to resume, or roll back to, the
    checkpoint it was converted from, and that one is no longer the newest; a resume from it converts again."""
    universal = root / UNIVERSAL_DIR
    if universal.is_dir():
        size = sum(p.stat().st_size for p in universal.rglob("*") if p.is_file())
        shutil.rmtree(universal, ignore_errors=True)
        log.info("removed the universal checkpoint copies in %s (%.2f GB)", universal, size / 1e9)


def prune_checkpoints(root: Path, limit: int, keep: Path) -> None:
    """Keep the newest `limit` committed checkpoints (0: keep all); `keep` (the one just committed) always stays."""
    if limit <= 0:
        return
    committed = sorted(
        (p for p in root.iterdir() if p.is_dir() and committed_step(p) is not None), key=committed_step, reverse=True
    )
    for old in committed[limit:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
            log.info("deleted checkpoint %s (--save_total_limit %d)", old, limit)


def load_checkpoint(engine, ckpt: Path, state: TrainState, rank: int, universal: bool = False) -> None:
    """Restore model, optimizer, LR schedule, loss scaler, the train state and this rank's RNG.

    universal: the checkpoint came from another number of ranks and is read from its universal conversion
    (the engine was configured with checkpoint.load_universal); RNG states do not map across rank counts.
    """
    import torch

    from scaletrain.model.lora import load_adapter_state

    started = time.perf_counter()
    source = universal_path(ckpt) if universal else ckpt
    # A LoRA checkpoint lacks the frozen base (save_checkpoint): the built base stays, the rest must fit exactly.
    path, client = engine.load_checkpoint(
        str(source.parent),
        tag=source.name,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        custom_load_fn=load_adapter_state if _without_frozen_base(engine) else None,
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt}")
    state.load_state_dict(client["train_state"])
    rng = ckpt / f"rng_state_rank{rank}.pt"
    if universal:
        log.info("resharded resume: RNG states start fresh (they do not map to another rank count)")
    elif rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    log.info(
        "resumed from %s (step %d, %d samples seen) in %.2fs",
        ckpt,
        state.step,
        state.samples_seen,
        time.perf_counter() - started,
    )


def state_is_sharded_by_tp(engine) -> bool:
    return int(engine.autotp_size() or 0) > 1


def _full_state_dict_on_rank0(engine, is_main: bool, trainable_only: bool = False) -> dict:
    """The trained weights as one CPU state dict on rank 0 (empty elsewhere); with trainable_only, the parameters
    that train (a LoRA adapter's) and nothing else.

    Under ZeRO-3 each rank holds a slice of every parameter; gathering them one at a time keeps the peak to one
    full parameter per rank, and the CPU copy on rank 0 is the only whole model anywhere. (Saving the module's
    own state_dict under ZeRO-3 is the known pitfall: it writes empty placeholders.)
    """
    import deepspeed

    module = engine.module
    if state_is_sharded_by_tp(engine):  # AutoTP shards: DeepSpeed gathers them (a collective)
        from scaletrain.engine.ds_internals import gathered_state_dict

        state = gathered_state_dict(engine)
        return {k: v.detach().cpu().clone() for k, v in state.items()} if is_main else {}
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad or not trainable_only]
    if engine.zero_optimization_stage() != 3:
        if not is_main:
            return {}
        if trainable_only:
            return {name: p.detach().cpu().clone() for name, p in params}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    state = {}
    for name, param in params:
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if is_main:
                state[name] = param.detach().cpu().clone()
    if is_main and not trainable_only:
        for name, buf in module.named_buffers():
            # Non-persistent buffers (rotary tables) are rebuilt from the config; only persistent ones are saved.
            if name in module.state_dict():
                state[name] = buf.detach().cpu().clone()
    return state


def export_pipeline_checkpoint(
    ckpt: Path, out_dir, model_config, tokenizer, dtype=None, max_shard_size: str = "5GB"
) -> None:
    """A Hugging Face folder from a pipeline checkpoint's layer files (the weights each stage holds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from scaletrain.distributed.pipeline import hf_state_dict_from_layer_files

    state = hf_state_dict_from_layer_files(ckpt, json.loads((ckpt / LAYER_MAP).read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(model_config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{ckpt}: the layer files do not match the model (missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)})"
        )
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out_dir)


def export_hf_model(
    engine, tokenizer, out_dir: str, is_main: bool, merge_lora: bool = False, trust_remote_code: bool = False
) -> None:
    """Write safetensors weights, config and tokenizer that `AutoModelForCausalLM.from_pretrained` loads; for a
    LoRA model the adapter folder instead (and with merge_lora the merged model in <out_dir>/merged)."""
    from scaletrain.model import lora
    from scaletrain.distributed.world import barrier

    if lora.is_lora_model(engine.module):
        adapter = _full_state_dict_on_rank0(engine, is_main, trainable_only=True)  # gathered: never placeholders
        if is_main:
            lora.save_adapter(engine.module, adapter, out_dir, tokenizer)
            if merge_lora:
                lora.merge_adapter(out_dir, lora.merged_dir(out_dir), tokenizer, trust_remote_code)
        barrier()
        return
    if hasattr(engine.module, "scaletrain_layers"):  # a pipeline: rank 0 reads every stage's layer files
        if is_main:
            export_pipeline_checkpoint(newest_committed(Path(out_dir)), out_dir, engine.module.hf_config, tokenizer)
            log.info("exported Hugging Face model to %s (from the pipeline's layer files)", out_dir)
        barrier()
        return
    state = _full_state_dict_on_rank0(engine, is_main)
    if is_main:
        engine.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        log.info("exported Hugging Face model to %s", out_dir)
    barrier()
