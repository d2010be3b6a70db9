"""Raw documents -> a token store, prepared once and shared: a fingerprint of the input, a cache folder keyed by
it, and the orchestration of ranks (local rank 0 of each node prepares under a file lock, the others wait on the
file system, and a failure marker stops them when the preparation fails)."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import cast

from scaletrain.config import DataArgs, OptimArgs
from scaletrain.errors import PreparerDied, TokenStoreFailed, UsageError
from scaletrain.data.raw import check_text_column, load_raw_datasets, local_data_files

log = logging.getLogger(__name__)

STORE_CACHE_ENV = "SCALETRAIN_CACHE"


# The held-out split is drawn with the run's --seed; data/prepare.py takes the same flag with the same default.
DEFAULT_SEED = cast(int, OptimArgs.__dataclass_fields__["seed"].default)  # a Field's default is typed loosely


def held_out_rule(data: DataArgs, seed: int) -> dict | None:
    """What decides the validation documents drawn from the training split, or None where none are drawn (a
    validation file is given, or --validation_split_percentage 0). A hub dataset may bring its own split: the rule
    is kept for it all the same, as which applies is known only once it is loaded."""
    if data.validation_split_percentage == 0 or data.validation_sets:
        return None
    return {
        "percentage": data.validation_split_percentage,
        "max_tokens": data.validation_split_max_tokens or None,
        "seed": seed,
    }


def store_fingerprint(data: DataArgs, tokenizer, block_size: int, seed: int = DEFAULT_SEED):
    from scaletrain.data.token_store import Fingerprint, source_identity, tokenizer_hash

    files = local_data_files(data)
    source = source_identity(
        None if data.dataset_name else files, data.dataset_name, data.dataset_config_name, data.dataset_revision
    )
    if data.dataset_name and files:  # --validation_file sets beside a dataset's training split
        source = {**source, "validation_files": source_identity(files, None, None)["splits"]}
    return Fingerprint(
        source=source,
        tokenizer_sha256=tokenizer_hash(tokenizer),
        block_size=block_size,
        text_column=data.text_column,
        held_out=held_out_rule(data, seed),
    )


def default_store_path(fingerprint) -> Path:
    """Where raw data given to train.py is prepared: a cache keyed by the fingerprint, shared by runs."""
    root = Path(os.environ.get(STORE_CACHE_ENV, Path.home() / ".cache" / "scaletrain")) / "token_stores"
    key = hashlib.sha256(json.dumps(fingerprint.as_dict(), sort_keys=True).encode()).hexdigest()[:16]
    return root / key


# A preparation of `store` works in two folders named for its process: the store being written, beside it (see
# token_store.write_store), and the Arrow conversion of local files, in the Hugging Face datasets cache (the disk that
# conversion always used), under a name derived from the store's path. A preparer killed half-way leaves both.
def partial_folders(store: Path, pid: str = "*", scratch: bool = True) -> list:
    """[(folder, glob pattern of that folder's names)]: where `store`'s preparations write before it is complete
    (without `scratch`: beside the store only)."""
    key = hashlib.sha256(str(store.resolve()).encode()).hexdigest()[:16]
    beside = [(store.parent, f".{glob.escape(store.name)}.tmp-{pid}")]
    return beside + [(scratch_root(), f"{key}.arrow-{pid}")] if scratch else beside


def scratch_root() -> Path:
    import datasets

    return Path(os.environ.get("HF_DATASETS_CACHE") or datasets.config.HF_DATASETS_CACHE) / "scaletrain-scratch"


@contextmanager
def exclusive_preparation(store: Path) -> Iterator[None]:
    """One preparer of `store` at a time (a lock file beside it; nodes sharing the file system too). Holding it, any
    partial folder of `store` was left by a preparer that died: it is removed, and so is the lock file at the end."""
    import fcntl

    store.parent.mkdir(parents=True, exist_ok=True)
    lock_path = store.parent / f".{store.name}.prepare.lock"
    while True:
        lock = open(lock_path, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.fstat(lock.fileno()).st_ino == os.stat(lock_path).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()  # the holder before us removed that file at its end: lock the current one
    try:
        # A complete store's leftovers in the scratch area were removed, under this lock, by the preparer that
        # finished it: not looking there again spares every later start an import of datasets (about 1 s) for its path.
        from scaletrain.data.token_store import MANIFEST

        for folder, pattern in partial_folders(store, scratch=not (store / MANIFEST).exists()):
            for partial in folder.glob(pattern):
                if partial.name.rsplit("-", 1)[1].isdigit():
                    size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
                    shutil.rmtree(partial, ignore_errors=True)
                    log.warning(
                        "token store %s: removed %s (%.1f MB), left by a preparation that did not finish",
                        store,
                        partial.name,
                        size / 1e6,
                    )
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        lock.close()


def prepare_token_store(
    data: DataArgs,
    tokenizer,
    tokenizer_dir: str,
    block_size: int,
    store: Path,
    *,
    show_progress: bool = True,
    seed: int = DEFAULT_SEED,
) -> Path:
    """Tokenize the run's raw data into `store` with --preprocessing_num_workers (default: the CPU count), or reuse
    the store there when it was made from the same input."""
    fingerprint = store_fingerprint(data, tokenizer, block_size, seed)
    with exclusive_preparation(store):
        return _prepare(
            data,
            tokenizer=tokenizer,
            tokenizer_dir=tokenizer_dir,
            fingerprint=fingerprint,
            store=store,
            show_progress=show_progress,
        )


def reusable_store(store: Path, fingerprint) -> dict | None:
    """The manifest of the store at `store` when it was made from the same input (reuse it); None when there is no
    store yet. A store from other input, or a folder that is not a store, is refused: nothing there is touched."""
    from scaletrain.data.token_store import MANIFEST, read_manifest

    if (store / MANIFEST).exists():
        manifest = read_manifest(store)
        differs = fingerprint.differences(manifest["fingerprint"])
        if not differs:
            return manifest
        raise UsageError(
            f"{store}: holds a token store made from different input ({', '.join(differs)} differ)",
            "choose another --output_dir, or delete that store",
        )
    if store.exists() and (not store.is_dir() or any(store.iterdir())):
        raise UsageError(
            f"{store}: exists and is not a token store (no {MANIFEST}); nothing there was changed",
            "choose a new or empty folder for the store",
        )
    return None


def _prepare(data: DataArgs, *, tokenizer, tokenizer_dir: str, fingerprint, store: Path, show_progress: bool) -> Path:
    import numpy as np

    from scaletrain.data.token_store import HeldOut, StoreInput, source_sha256, write_store

    manifest = reusable_store(store, fingerprint)
    if manifest is not None:
        made_from = f"; made from commit {manifest['source_revision']}" if "source_revision" in manifest else ""
        log.info("token store %s: reusing it (same input, tokenizer and block size%s)", store, made_from)
        return store
    folder, name = partial_folders(store, str(os.getpid()))[1]
    scratch = folder / name
    try:
        train, validation, revision = load_raw_datasets(data, scratch_dir=scratch)
        files = local_data_files(data)
        source = data.dataset_name or ", ".join(files["train"])
        check_text_column(train, data.text_column, source)
        for split, documents in validation.items():
            check_text_column(documents, data.text_column, ", ".join(files.get(split, [])) or f"{source} ({split})")
        held_out = None
        if not validation and fingerprint.held_out and len(train) > 1:
            # At random, not the corpus's first documents (often one source, or one period, of a concatenated corpus).
            held_out = HeldOut(
                order=np.random.default_rng(fingerprint.held_out["seed"]).permutation(len(train)),
                documents=max(1, len(train) * data.validation_split_percentage // 100),
                max_tokens=fingerprint.held_out["max_tokens"],
            )
        workers = data.preprocessing_num_workers or os.cpu_count() or 1
        started = time.perf_counter()
        # The content hash, once, here: the lookup (every rank, every start) goes by path, size and modification time.
        store_input = StoreInput(
            splits={"train": train, **validation},
            fingerprint=fingerprint,
            held_out=held_out,
            content_sha256=source_sha256(files) or None,
            source_revision=revision,
        )
        write_store(store_input, tokenizer, tokenizer_dir, store, num_proc=workers, show_progress=show_progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the Arrow copy of local files: the store is what is kept
    log.info(
        "token store %s: prepared in %.1fs, tokenizer parallelism %d", store, time.perf_counter() - started, workers
    )
    return store


def launch_identity() -> str:
    """The same for every local rank of one launch on a node, different for the next launch: the launcher process
    (deepspeed's launch.py, torchrun's agent, or srun's step daemon) and the restart counts of torchrun and Slurm."""
    env = os.environ
    return ":".join(
        [
            str(os.getppid()),
            env.get("TORCHELASTIC_RESTART_COUNT", ""),
            env.get("SLURM_JOB_ID", ""),
            env.get("SLURM_STEP_ID", ""),
            env.get("SLURM_RESTART_COUNT", ""),
        ]
    )


def _read_failure(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none, or caught half-written: look again at the next poll
        return None


def ensure_token_store(
    data: DataArgs,
    tokenizer,
    tokenizer_dir: str,
    block_size: int,
    local_rank: int,
    show_progress: bool,
    seed: int = DEFAULT_SEED,
) -> Path:
    """The token store of the raw data given to train.py, prepared once (ensure_store)."""
    fingerprint = store_fingerprint(data, tokenizer, block_size, seed)

    def prepare(store: Path) -> Path:
        return prepare_token_store(
            data,
            tokenizer=tokenizer,
            tokenizer_dir=tokenizer_dir,
            block_size=block_size,
            store=store,
            show_progress=show_progress,
            seed=seed,
        )

    return ensure_store(default_store_path(fingerprint), local_rank, prepare)


def ensure_store(store: Path, local_rank: int, prepare: Callable[[Path], Path]) -> Path:
    """Local rank 0 of each node prepares `store` (under a file lock, so nodes sharing a file system prepare it
    once); the other ranks wait for its manifest by polling the file system, with no collective and so no timeout
    however long preparation takes. The wait has two ways out: the failure marker local rank 0 writes when the
    preparation fails, and a lock it holds while it prepares, which a killed preparer (the out-of-memory killer, a
    signal) releases: under `srun` no launcher stops the waiting ranks."""
    import fcntl
    import socket

    from scaletrain.data.token_store import MANIFEST

    store.parent.mkdir(parents=True, exist_ok=True)
    # One marker per node: on a shared file system each node's local rank 0 reports to its own node's ranks.
    failed = store.parent / f"{store.name}.{socket.gethostname()}.failed"
    preparer = store.parent / f"{store.name}.{socket.gethostname()}.preparer"
    if local_rank == 0:
        with open(preparer, "a+") as alive, open(store.parent / f"{store.name}.lock", "w") as lock:
            fcntl.flock(alive, fcntl.LOCK_EX)  # held until this preparer returns or dies
            alive.truncate(0)
            alive.write(json.dumps({"launch": launch_identity(), "pid": os.getpid()}) + "\n")
            alive.flush()
            fcntl.flock(lock, fcntl.LOCK_EX)
            failed.unlink(missing_ok=True)
            try:
                return prepare(store)
            except BaseException as err:
                # Tell the waiting ranks, which no launcher is bound to kill (srun without --kill-on-bad-exit).
                kind = "usage" if isinstance(err, UsageError) else "failed"
                failed.write_text(
                    json.dumps({"launch": launch_identity(), "kind": kind, "error": str(err) or type(err).__name__})
                    + "\n"
                )
                raise
    waited = 0.0
    while not (store / MANIFEST).exists():
        gone = _preparer_gone(preparer)  # looked at first: a preparer that ends leaves a manifest or a marker
        report = _read_failure(failed)
        if report is not None and report.get("launch") == launch_identity():  # not an earlier launch's failure
            if report["kind"] == "usage":
                raise UsageError(report["error"])
            raise TokenStoreFailed(f"local rank 0 could not prepare the token store {store}: {report['error']}")
        if gone is not None and not (store / MANIFEST).exists():
            raise PreparerDied(
                f"waited for local rank 0 (pid {gone}) to prepare the token store {store}: it ended "
                "without finishing it or saying why (killed? out of memory?); nothing of the store "
                "is used. Restart the job (lower --preprocessing_num_workers if memory ran out)"
            )
        time.sleep(1.0)
        waited += 1.0
        if waited % 300 == 0:
            log.warning("still waiting for local rank 0 to prepare the token store %s (%.0f min)", store, waited / 60)
    return store


def _preparer_gone(record: Path) -> int | None:
    """The pid of this launch's preparer when it no longer holds its lock (it ended), else None. A record of
    another launch (a preparer not yet started, or another job's on this host) says nothing about ours."""
    import fcntl

    try:
        with open(record) as probe:
            owner = json.loads(probe.read() or "{}")
            if owner.get("launch") != launch_identity():
                return None
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return owner.get("pid")  # free: closing the file releases it again
    except BlockingIOError:
        return None
    except (OSError, ValueError):  # not written yet
        return None
