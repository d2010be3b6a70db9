"""The commit protocol of a checkpoint folder and what reads it back: checkpoints/'s layout, atomic writes, SHA-256
checksums, rank 0's commit (commit.json, the rename of .tmp-stepN to stepN, then `latest`), finding the newest good
checkpoint, damage detection with its fallback, pruning, and clearing a previous run. It exists because DeepSpeed alone
writes its `latest` before its last barrier, so a kill can leave it naming a half-written checkpoint. save.py runs the
steps; the protocol: docs/checkpoints.md#commit-protocol.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from scaletrain.errors import UsageError

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
# A checkpoint's universal conversion (resume.ensure_universal) lives beside it, in checkpoints/.universal/stepN.
UNIVERSAL_DIR = ".universal"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_to_disk(paths) -> None:
    """Each file's data, then the entries of the folders holding them, on disk (fsync), before a commit names them:
    a node that crashes after the commit leaves no committed checkpoint with a torn file."""
    paths = [Path(p) for p in paths]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for folder in dict.fromkeys(path.parent for path in paths):
        _fsync_dir(folder)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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


def committed_step_key(path: Path) -> int:
    """committed_step of a path known to be a committed checkpoint: a sort key."""
    step = committed_step(path)
    assert step is not None  # the caller kept committed checkpoints only
    return step


def universal_path(ckpt: Path) -> Path:
    return ckpt.parent / UNIVERSAL_DIR / ckpt.name


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


def newest_committed(output_dir: str | Path) -> Path | None:
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
            if p.is_dir() and (step := committed_step(p)) is not None and (below is None or step < below)
        ),
        key=committed_step_key,
        reverse=True,
    )
    for ckpt in candidates:
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        log.warning("skipping checkpoint %s: %s", ckpt, problem)
    return None


def checksum_shares(files: dict, world_size: int) -> list:
    """The files of a commit record ({name: size}) split among the ranks by size, largest first, each to the rank
    with the fewest bytes so far: every file is hashed once, each rank reads about 1/world_size of the bytes."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
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
    from scaletrain.distributed import all_gather_objects

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
        f"checked the SHA-256 of {len(mine)} of {ckpt}'s files ({sum(commit['files'][rel] for rel in mine) / 1e6:.1f} "
        f"MB) in {time.perf_counter() - started:.2f}s on rank {rank}"
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
        write_atomically(latest, fallback.name + "\n")
    return target


def verified_resume_checkpoint(ckpt: Path, auto: bool, rank: int, world_size: int) -> Path:
    """The checkpoint to resume after every rank checked the SHA-256 of its files (find_damage): `ckpt`, or, when
    it is damaged and was chosen by `auto`, the previous committed checkpoint that checks out (rank 0 chooses it
    and marks the damaged one, mark_damaged; one warning). A damaged checkpoint asked for by path, or one with no
    earlier committed checkpoint, stops every rank with one message (UsageError), the damaged one left in place."""
    from scaletrain.distributed import all_gather_objects, barrier

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
                f"checkpoint {ckpt} is damaged: {damage}; falling back to {fallback} (the damaged one is kept as {kept}"
                ", and no later resume picks it)"
            )
        barrier()  # renamed before any rank looks at the folder again
        ckpt = Path(fallback)


def commit_checkpoint(tmp: Path, *, final: Path, root: Path, step: int, checksums: dict) -> float:
    """Rank 0: commit.json (sizes and SHA-256 of every file; a file no rank recorded, such as DeepSpeed's recovery
    script, is hashed here), the rename to its final name and the `latest` pointer. Returns the seconds hashing."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    unrecorded = [tmp / rel for rel in files if rel not in checksums]  # DeepSpeed's recovery script: on disk first
    sync_to_disk(unrecorded)
    started = time.perf_counter()
    sums = {rel: checksums.get(rel) or file_checksum(tmp / rel) for rel in files}
    hashed = time.perf_counter() - started
    write_atomically(tmp / COMMIT, json.dumps({"step": step, "files": files, CHECKSUM: sums}, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    write_atomically(root / LATEST, final.name + "\n")
    return hashed


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
        (p for p in root.iterdir() if p.is_dir() and committed_step(p) is not None),
        key=committed_step_key,
        reverse=True,
    )
    for old in committed[limit:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
            log.info("deleted checkpoint %s (--save_total_limit %d)", old, limit)


def clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir without resuming: the old checkpoints, metrics, goodput ledger and hang reports go, so
    nothing stale resumes or is counted as an earlier attempt of this run."""
    from scaletrain.train import HANG_DIR

    out = Path(output_dir)
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    shutil.rmtree(out / HANG_DIR, ignore_errors=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    (out / "goodput.json").unlink(missing_ok=True)
