"""Raw documents -> a token store, prepared once and shared: a fingerprint of the input, a cache folder keyed by
it, and the orchestration of ranks (local rank 0 of each node prepares under a file lock, the others wait on the
file system, and a failure marker stops them when the preparation fails)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

from scaletrain.config import DataArgs
from scaletrain.errors import TokenStoreFailed, UsageError
from scaletrain.raw_data import check_text_column, load_raw_datasets, local_data_files

log = logging.getLogger(__name__)

STORE_CACHE_ENV = "SCALETRAIN_CACHE"


def store_fingerprint(data: DataArgs, tokenizer, block_size: int):
    from scaletrain.tokenstore import Fingerprint, source_identity, tokenizer_hash

    files = None if data.dataset_name else local_data_files(data)
    return Fingerprint(
        source=source_identity(files, data.dataset_name, data.dataset_config_name),
        tokenizer_sha256=tokenizer_hash(tokenizer),
        block_size=block_size,
        text_column=data.text_column,
        validation_split_percentage=data.validation_split_percentage,
    )


def default_store_path(fingerprint) -> Path:
    """Where raw data given to train.py is prepared: a cache keyed by the fingerprint, shared by runs."""
    root = Path(os.environ.get(STORE_CACHE_ENV, Path.home() / ".cache" / "scaletrain")) / "token_stores"
    key = hashlib.sha256(json.dumps(fingerprint.as_dict(), sort_keys=True).encode()).hexdigest()[:16]
    return root / key


def prepare_token_store(data: DataArgs, tokenizer, tokenizer_dir: str, block_size: int, store: Path,
                        num_proc: Optional[int], show_progress: bool = True) -> Path:
    """Tokenize the run's raw data into `store`, or reuse the store there when it was made from the same input."""
    from scaletrain.tokenstore import MANIFEST, read_manifest, write_store

    fingerprint = store_fingerprint(data, tokenizer, block_size)
    if (store / MANIFEST).exists():
        differs = fingerprint.differences(read_manifest(store)["fingerprint"])
        if not differs:
            log.info("token store %s: reusing it (same input, tokenizer and block size)", store)
            return store
        raise UsageError(f"{store}: holds a token store made from different input ({', '.join(differs)} differ)",
                         "choose another --output_dir, or delete that store")
    if store.exists() and (not store.is_dir() or any(store.iterdir())):
        raise UsageError(f"{store}: exists and is not a token store (no {MANIFEST}); nothing there was changed",
                         "choose a new or empty folder for the store")
    train, validation = load_raw_datasets(data)
    source = data.dataset_name or ", ".join(local_data_files(data)["train"])
    check_text_column(train, data.text_column, source)
    if validation is not None:
        check_text_column(validation, data.text_column, f"{source} (validation)")
    workers = num_proc or os.cpu_count() or 1
    started = time.perf_counter()
    write_store({"train": train, "validation": validation}, tokenizer, tokenizer_dir, fingerprint, store,
                num_proc=workers, show_progress=show_progress)
    log.info("token store %s: prepared in %.1fs, tokenizer parallelism %d", store, time.perf_counter() - started,
             workers)
    return store


def launch_identity() -> str:
    """The same for every local rank of one launch on a node, different for the next launch: the launcher process
    (deepspeed's launch.py, torchrun's agent, or srun's step daemon) and the restart counts of torchrun and Slurm."""
    env = os.environ
    return ":".join([str(os.getppid()), env.get("TORCHELASTIC_RESTART_COUNT", ""), env.get("SLURM_JOB_ID", ""),
                     env.get("SLURM_STEP_ID", ""), env.get("SLURM_RESTART_COUNT", "")])


def _read_failure(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none, or caught half-written: look again at the next poll
        return None



def ensure_token_store(data: DataArgs, tokenizer, tokenizer_dir: str, block_size: int, local_rank: int,
                       show_progress: bool, fingerprint=None, prepare=None) -> Path:
    """Raw data given to train.py: local rank 0 of each node prepares the store (under a file lock, so nodes
    sharing a file system prepare it once); the other ranks wait for its manifest by polling the file system,
    with no collective and so no timeout however long preparation takes. Runs before any process group exists.
    Another kind of store (chat data: scaletrain/chat_store.py) comes with its `fingerprint` and `prepare(store)`.
    """
    import fcntl
    import socket

    from scaletrain.tokenstore import MANIFEST

    store = default_store_path(fingerprint or store_fingerprint(data, tokenizer, block_size))
    store.parent.mkdir(parents=True, exist_ok=True)
    # One marker per node: on a shared file system each node's local rank 0 reports to its own node's ranks.
    failed = store.parent / f"{store.name}.{socket.gethostname()}.failed"
    if local_rank == 0:
        with open(store.parent / f"{store.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            failed.unlink(missing_ok=True)
            try:
                if prepare is not None:
                    return prepare(store)
                return prepare_token_store(data, tokenizer, tokenizer_dir, block_size, store,
                                           data.preprocessing_num_workers, show_progress)
            except BaseException as err:
                # Tell the waiting ranks, which no launcher is bound to kill (srun without --kill-on-bad-exit).
                kind = "usage" if isinstance(err, UsageError) else "failed"
                failed.write_text(json.dumps({"launch": launch_identity(), "kind": kind,
                                              "error": str(err) or type(err).__name__}) + "\n")
                raise
    waited = 0.0
    while not (store / MANIFEST).exists():
        report = _read_failure(failed)
        if report is not None and report.get("launch") == launch_identity():  # not an earlier launch's failure
            if report["kind"] == "usage":
                raise UsageError(report["error"])
            raise TokenStoreFailed(f"local rank 0 could not prepare the token store {store}: {report['error']}")
        time.sleep(1.0)
        waited += 1.0
        if waited % 300 == 0:
            log.warning("still waiting for local rank 0 to prepare the token store %s (%.0f min)", store, waited / 60)
    return store
