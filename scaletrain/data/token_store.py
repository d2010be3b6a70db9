"""The token store: a corpus tokenized once into memory-mapped files, with a fingerprinted manifest; written under a
temporary name and renamed when complete, so a half-written store never looks like one (docs/data.md#token-stores).

    manifest.json            format version, fingerprint, per-split token/document counts, the sources' SHA-256
    <split>.tokens.bin       every document's tokens followed by EOS, concatenated (uint16 or uint32)
    <split>.docs.npy         the offset where each document starts (int64), for attention isolation
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

import numpy as np

from scaletrain.errors import PrepareError, UsageError

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PACKING = "concat_eos"  # documents joined with EOS, cut into blocks; the last partial block padded, never dropped
HASH_CHUNK = 1 << 20
# Up to this many --num_proc, one process tokenizes with that many Rust threads; above it, worker processes
# (one thread each) also parallelise the Python side. Measured on 2 cores: threads 1.36M tokens/s, 2 processes 0.94M.
MAX_TOKENIZER_THREADS = 8


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """Identity of a tokenizer: its full serialized vocabulary and rules plus the special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps({"eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id}, sort_keys=True)
    return hashlib.sha256((body + special).encode()).hexdigest()


def source_identity(
    files: dict | None, dataset_name: str | None, dataset_config: str | None, revision: str | None = None
) -> dict:
    """Local files (or a local dataset folder's) by path, size and modification time; a save_to_disk folder by its
    Arrow files; a hub dataset by name, config and revision. Every rank computes this at every start, so it reads no
    file's content; the preparer records the content hash (source_sha256) once."""
    if files:
        return {
            "kind": "files",
            "splits": {
                split: [
                    {"path": str(Path(p).resolve()), "size": (st := Path(p).stat()).st_size, "mtime_ns": st.st_mtime_ns}
                    for p in paths
                ]
                for split, paths in files.items()
            },
        }
    assert dataset_name is not None, "a source is local files or a dataset"  # the caller passes one of the two
    path = Path(dataset_name)
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists()):
        state = sorted(p for p in path.rglob("*.arrow"))
        return {
            "kind": "save_to_disk",
            "path": str(path.resolve()),
            "arrow": [{"path": str(p.relative_to(path)), "size": p.stat().st_size} for p in state],
        }
    if path.is_dir():  # a folder of data files that load_dataset reads as a dataset: its files, as for --train_file
        found = sorted(p for p in path.rglob("*") if p.is_file() and not p.relative_to(path).parts[0].startswith("."))
        return {
            "kind": "folder",
            "path": str(path.resolve()),
            "config": dataset_config,
            "files": [
                {"path": str(p.relative_to(path)), "size": (st := p.stat()).st_size, "mtime_ns": st.st_mtime_ns}
                for p in found
            ],
        }
    return {"kind": "hub", "name": dataset_name, "config": dataset_config, "revision": revision}


def source_sha256(files: dict) -> dict:
    """{split: {path: SHA-256 of its content}}: what the store was made from, kept in its manifest."""
    return {split: {str(Path(p).resolve()): file_sha256(Path(p)) for p in paths} for split, paths in files.items()}


@dataclass(frozen=True)
class Fingerprint:
    source: dict
    tokenizer_sha256: str
    block_size: int
    text_column: str
    held_out: dict | None  # how validation is drawn from the training documents (percentage, max_tokens, seed)
    packing: str = PACKING
    format_version: int = FORMAT_VERSION

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "tokenizer_sha256": self.tokenizer_sha256,
            "block_size": self.block_size,
            "text_column": self.text_column,
            "held_out": self.held_out,
            "packing": self.packing,
            "format_version": self.format_version,
        }

    def differences(self, other: dict) -> list:
        mine = self.as_dict()
        return [key for key in mine if mine[key] != other.get(key)]


@dataclass
class StoreSplit:
    tokens: np.ndarray  # flat memmap of token ids
    doc_starts: np.ndarray  # offset of each document's first token

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_documents(self) -> int:
        return len(self.doc_starts)


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def read_manifest(store: Path) -> dict:
    path = store / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(
            f"--data_path {store}: not a token store (no {MANIFEST})",
            "prepare one with python data/prepare.py --output_dir ...",
        ) from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--data_path {store}: unreadable {MANIFEST} ({exc})", "prepare the store again") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UsageError(
            f"--data_path {store}: store format version {manifest.get('format_version')}, this code "
            f"reads version {FORMAT_VERSION}",
            "prepare the store again with this version",
        )
    return manifest


def open_store(store: Path, expected: Fingerprint | None = None) -> dict:
    """Open every split of a store as memmaps, after checking its manifest and file sizes."""
    manifest = read_manifest(store)
    if expected is not None:
        differs = expected.differences(manifest["fingerprint"])
        if differs:
            raise UsageError(
                f"--data_path {store}: prepared from different input ({', '.join(differs)} differ)",
                "prepare a new store for this input, or point --data_path at the matching one",
            )
    dtype = np.dtype(manifest["dtype"])
    splits = {}
    for split, info in manifest["splits"].items():
        tokens_path, docs_path = store / f"{split}.tokens.bin", store / f"{split}.docs.npy"
        expected_bytes = info["n_tokens"] * dtype.itemsize
        actual = tokens_path.stat().st_size if tokens_path.exists() else -1
        if actual != expected_bytes:
            raise UsageError(
                f"--data_path {store}: {tokens_path.name} holds {actual} bytes, the manifest says "
                f"{expected_bytes} (truncated or corrupt)",
                "prepare the store again",
            )
        try:
            doc_starts = np.load(docs_path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise UsageError(
                f"--data_path {store}: {docs_path.name} is unreadable ({exc})", "prepare the store again"
            ) from exc
        if len(doc_starts) != info["n_documents"]:
            raise UsageError(
                f"--data_path {store}: {docs_path.name} holds {len(doc_starts)} documents, the "
                f"manifest says {info['n_documents']}",
                "prepare the store again",
            )
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if info["n_tokens"] else np.zeros(0, dtype)
        splits[split] = StoreSplit(tokens, doc_starts)
    return {"manifest": manifest, "splits": splits, "path": Path(store)}


# --- writing ---------------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_file: str, eos: int, dtype: str, add_special: bool, parent_pid: int | None) -> None:
    """Load the Rust tokenizer alone, from its JSON (no transformers import per worker: seconds saved). In a worker
    process (`parent_pid` given): one tokenizer thread, and the worker dies with the process that started it."""
    from tokenizers import Tokenizer

    if parent_pid is not None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process: no oversubscription
        _die_with_parent(parent_pid)
    _WORKER.update(
        tokenizer=Tokenizer.from_file(tokenizer_file), eos=eos, dtype=np.dtype(dtype), add_special=add_special
    )


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker when its parent exits, however it exits (a SIGKILL too): no orphan is left
    tokenizing for nobody, holding the terminal's or a pipe's output open."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent was already gone before the line above
        os._exit(1)


def _encode_texts(texts: list) -> tuple:
    """Tokens of a batch of documents, each followed by EOS, and each document's length."""
    w = _WORKER
    # encode_batch_fast skips the character offsets that training never uses (a good part of the work).
    encodings = w["tokenizer"].encode_batch_fast([t or "" for t in texts], add_special_tokens=w["add_special"])
    ids = [e.ids for e in encodings]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=w["dtype"])
    ends = np.cumsum(lengths)
    flat[ends - 1] = w["eos"]
    starts = ends - lengths
    for i, x in enumerate(ids):
        flat[starts[i] : ends[i] - 1] = x
    return flat, lengths


def _batches(ds, column: str, batch_size: int) -> Iterator[list]:
    for batch in ds.select_columns([column]).iter(batch_size=batch_size):
        yield batch[column]


class WorkerDied(Exception):
    """A worker process ended without returning its batch: (what happened, whether SIGKILL ended it)."""

    def as_prepare_error(self, store: str, worker: str, flag: str) -> PrepareError:
        """The preparation's one-line failure: `store` names it, `worker` the kind of worker, `flag` the knob."""
        what, sigkill = self.args
        hint = (
            f"The usual cause is the out-of-memory killer: retry with a smaller {flag}"
            if sigkill
            else "Its own error is printed above"
        )
        return PrepareError(f"{store}: a {worker} worker process died ({what}); nothing was kept. " + hint)


def _worker_main(conn, init, work, init_args: tuple, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    init(*init_args, parent_pid)
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        try:
            result = (True, work(batch))
        except Exception as err:  # the batch's own error (a bad row): raised again in the parent, the worker lives
            result = (False, err)
        conn.send(result)


class WorkerPool:
    """Worker processes fed round robin and read back in order, so a store is the same for any --num_proc; one batch
    per worker at a time, so no pipe fills both ways. A dead worker (the out-of-memory killer) shows at once as a
    closed pipe: multiprocessing.Pool.imap waits forever for its batch, and concurrent.futures' pool races its
    bookkeeping when a worker dies while others start (CPython 3.11). A worker runs `init(*init_args, parent_pid)` once,
    then `work(batch)` per batch; an exception in `work` is raised again here, in the batch's turn.
    """

    def __init__(self, n: int, init_args: tuple, init=_init_worker, work=_encode_texts):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(theirs, init, work, init_args, os.getpid()), daemon=True)
            proc.start()
            theirs.close()  # only the worker holds its end: its death closes the pipe for us
            self.conns.append(ours)
            self.procs.append(proc)

    def _send(self, k: int, batch: list) -> None:
        try:
            self.conns[k % len(self.conns)].send(batch)
        except OSError:  # the worker's end is closed: it died
            self._died(k % len(self.conns))

    def _recv(self, k: int) -> tuple:
        try:
            ok, result = self.conns[k % len(self.conns)].recv()
        except (EOFError, OSError):  # closed before or in the middle of a message: it died
            self._died(k % len(self.conns))
        if not ok:
            raise result
        return result

    def _died(self, worker: int):
        proc = self.procs[worker]
        proc.join(timeout=5)
        code = proc.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        raise WorkerDied(f"worker {worker} of {len(self.procs)}, {how}", code == -signal.SIGKILL)

    def map(self, batches: Iterator[list]) -> Iterator[tuple]:
        batches = iter(batches)
        sent = 0
        for _ in self.conns:  # one batch to each worker
            batch = next(batches, None)
            if batch is None:
                break
            self._send(sent, batch)
            sent += 1
        for k in itertools.count():
            if k == sent:
                return
            result = self._recv(k)
            batch = next(batches, None)
            if batch is not None:  # batch `sent` goes to the worker just freed: sent % n == k % n
                self._send(sent, batch)
                sent += 1
            yield result

    def close(self, finished: bool) -> None:
        """Finished: let each idle worker exit. Otherwise (an error, Ctrl-C): kill them, their work is unwanted."""
        for conn in self.conns if finished else ():
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10 if finished else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


def _write_split(ds, split: str, writing: _Writing, max_tokens: int | None = None) -> dict:
    """Tokenize `ds` into `split`'s files; with max_tokens, only its first documents up to that many tokens (at least
    one document), and the rest is not read."""
    from tqdm.auto import tqdm

    doc_lengths = []
    n_tokens = 0
    full = False

    def batches() -> Iterator[list]:
        for batch in _batches(ds, writing.column, writing.batch_size):
            if full:
                return
            yield batch

    with (
        tqdm(total=len(ds), desc=f"tokenizing {split}", unit="doc", disable=not writing.show_progress) as bar,
        open(writing.out / f"{split}.tokens.bin", "wb") as f,
    ):  # the bar ends its line even on an error
        for flat, lengths in writing.encode(batches()):
            if full:
                continue  # batches already with the worker processes when the cap was reached
            if max_tokens is not None:
                ends = np.cumsum(lengths)
                keep = max(int(np.searchsorted(ends, max_tokens - n_tokens, side="right")), int(n_tokens == 0))
                if keep < len(lengths):
                    full = True
                    flat, lengths = flat[: int(ends[keep - 1]) if keep else 0], lengths[:keep]
            f.write(flat.tobytes())
            doc_lengths.append(lengths)
            n_tokens += len(flat)
            bar.update(len(lengths))
    lengths = np.concatenate(doc_lengths) if doc_lengths else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    np.save(writing.out / f"{split}.docs.npy", starts.astype(np.int64))
    return {"n_tokens": n_tokens, "n_documents": int(len(lengths))}


@dataclass(frozen=True)
class HeldOut:
    """Validation documents drawn from the training split: the first `documents` of a seeded random order of its
    documents, as long as they fit in `max_tokens` tokens (None: no cap); the training split keeps the rest."""

    order: np.ndarray  # a permutation of the training split's document indices
    documents: int
    max_tokens: int | None


@dataclass(frozen=True, kw_only=True)
class StoreInput:
    """What a store is written from: the loaded splits (by name; with `held_out`, validation is drawn from "train"),
    the fingerprint they match, and what the manifest records beside it (the source files' SHA-256, the hub
    dataset's commit)."""

    splits: dict
    fingerprint: Fingerprint
    held_out: HeldOut | None = None
    content_sha256: dict | None = None
    source_revision: str | None = None


@dataclass(frozen=True)
class _Writing:
    """How each split is written: into folder `out`, `column`'s texts in batches of `batch_size` through `encode`."""

    out: Path
    column: str
    batch_size: int
    encode: Callable[[Iterator[list]], Iterator[tuple]]
    show_progress: bool


def _write_held_out(documents, held_out: HeldOut, writing: _Writing) -> tuple:
    """(validation's counts, the training split without the held-out documents, in their original order)."""
    # Index mappings in the temporary store (removed with it), never beside the user's own dataset files.
    candidates = documents.select(
        held_out.order[: held_out.documents], indices_cache_file_name=str(writing.out / "validation.indices.arrow")
    )
    counts = _write_split(candidates, "validation", writing, max_tokens=held_out.max_tokens)
    rest = np.sort(held_out.order[counts["n_documents"] :])
    return counts, documents.select(rest, indices_cache_file_name=str(writing.out / "train.indices.arrow"))


def _save_tokenizer(tokenizer, path: Path) -> None:
    try:
        tokenizer.backend_tokenizer.save(str(path))
    except Exception as err:  # the Rust library raises a plain Exception that names the OS error
        if f"os error {errno.ENOSPC})" in str(err):
            raise OSError(errno.ENOSPC, str(err), str(path)) from None
        raise


def write_store(
    source: StoreInput,
    tokenizer,
    tokenizer_dir: str,
    store: Path,
    num_proc: int,
    show_progress: bool = True,
    batch_size: int = 1000,
) -> Path:
    """Tokenize every split of `source` into `store`, atomically: a temporary folder renamed into place when
    complete."""
    store = Path(store)
    _require_fast(tokenizer, tokenizer_dir)
    dtype = _dtype_for(len(tokenizer))
    add_special = _adds_special_tokens(tokenizer)
    tmp = store.parent / f".{store.name}.tmp-{os.getpid()}"  # preparation.partial_folders: removed if left
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer_file = tmp / "worker_tokenizer.json"
    pool, finished = None, False
    try:
        # Workers read the tokenizer from a file: passed inline (megabytes for a large vocabulary), it would be
        # written into each new worker's start-up pipe, a write that never returns if the worker is killed starting.
        _save_tokenizer(tokenizer, tokenizer_file)
        init_args = (str(tokenizer_file), tokenizer.eos_token_id, dtype.str, add_special)
        started = time.perf_counter()
        pool, encode = _start_encoder(num_proc, init_args)
        writing = _Writing(
            tmp,
            column=source.fingerprint.text_column,
            batch_size=batch_size,
            encode=encode,
            show_progress=show_progress,
        )
        counts = _write_splits(source.splits, source.held_out, writing)
        tokenizer_file.unlink()
        for mapping in tmp.glob("*.indices.arrow"):
            mapping.unlink()
        manifest = _manifest(source, dtype=dtype, tokenizer=tokenizer, counts=counts, started=started)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, store)  # onto nothing, or an empty folder (prepare_token_store refuses any other)
        finished = True
    except WorkerDied as err:
        raise err.as_prepare_error(f"token store {store}", "tokenizer", "--num_proc") from None
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise PrepareError(
            f"token store {store}: the disk holding {store.parent} is full; nothing was kept. "
            "Free space there or write the store on another disk"
        ) from None
    finally:
        if pool is not None:
            pool.close(finished)
        shutil.rmtree(tmp, ignore_errors=True)  # the partial store after a failure (renamed away after a success)
    return store


def _require_fast(tokenizer, tokenizer_dir: str) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise UsageError(
            f"tokenizer {tokenizer_dir}: the token store needs a fast (Rust) tokenizer",
            "use a tokenizer with a tokenizer.json",
        )


def _adds_special_tokens(tokenizer) -> bool:
    """Whether the workers encode with special tokens: not when the tokenizer appends EOS itself, which would double
    it; the store adds exactly one after each document."""
    # The backend's single encode: a batch call here would start the Rust thread pool at its default size before
    # RAYON_NUM_THREADS (_start_encoder) is set, and --num_proc 1 would then still tokenize on every core.
    probe = tokenizer.backend_tokenizer.encode("x", add_special_tokens=True).ids
    return not (probe and probe[-1] == tokenizer.eos_token_id)


def _start_encoder(num_proc: int, init_args: tuple[str, int, str, bool]) -> tuple:
    """(the worker pool or None, encode: batches of texts -> (flat ids, lengths) per batch)."""
    if num_proc > MAX_TOKENIZER_THREADS:
        pool = WorkerPool(num_proc, init_args)
        return pool, pool.map
    # One process: the Rust tokenizer's threads beat worker processes (no start-up, no pickling) until the serial
    # Python part (ids -> array) is the bottleneck.
    os.environ.setdefault("RAYON_NUM_THREADS", str(num_proc))
    _init_worker(*init_args, None)
    return None, lambda batches: map(_encode_texts, batches)


def _write_splits(splits: dict, held_out: HeldOut | None, writing: _Writing) -> dict:
    """Every split's counts by name, validation first when it is held out of the training split."""
    counts = {}
    if held_out is not None:
        counts["validation"], train = _write_held_out(splits["train"], held_out, writing)
        splits = {"train": train}
    counts.update({name: _write_split(ds, name, writing) for name, ds in splits.items() if ds is not None})
    return counts


def _manifest(source: StoreInput, *, dtype: np.dtype, tokenizer, counts: dict, started: float) -> dict:
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": source.fingerprint.as_dict(),
        "dtype": dtype.str,
        "eos_id": tokenizer.eos_token_id,
        "pad_id": tokenizer.pad_token_id,
        "splits": counts,
        "prepared_seconds": round(time.perf_counter() - started, 2),
    }
    if source.content_sha256 is not None:
        manifest["source_sha256"] = source.content_sha256
    if source.source_revision is not None:
        manifest["source_revision"] = source.source_revision  # the hub dataset's commit the store was made from
    return manifest
