"""Asynchronous saves (--async_save): training pauses only while each rank copies the state dicts DeepSpeed's
save_checkpoint would write (taken, not written: ds_internals.recorded_checkpoint_writes) into /dev/shm buffers that it
and its writer process both map; the writer rebuilds the same objects, views sharing storage as before, so torch.save
writes the same bytes. A process, not a thread: torch.save's pickling holds the GIL. At most one save is in flight;
commit.py's protocol commits it at a later step boundary once every rank's write is done. Drains and failures:
docs/checkpoints.md#asynchronous-saves.
"""

from __future__ import annotations

import atexit
import errno
import gc
import logging
import os
import pickle
import shutil
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    import torch

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a snapshot, by reference to the host buffer holding its storage's bytes."""

    index: int  # the storage's buffer
    dtype: torch.dtype
    offset: int
    size: tuple
    stride: tuple
    parameter: bool  # an nn.Parameter (torch.save keeps the class)
    requires_grad: bool
    attributes: dict | None = None  # the tensor's Python attributes (DeepSpeed's ds_id, ...), which torch.save keeps


MEASURED = object()  # snapshot_refusal's default: read the value here
BUFFER_PREFIX = "scaletrain-snapshot-"
WRITER_NAME = "st-writer"  # the writer process's name (comm) once it is ready to write


class HostBuffers:
    """The host buffers snapshots are copied into: one file in /dev/shm per storage, mapped here and in the writer,
    reused from save to save (grown when a storage grew). Named after the rank's pid: the buffers of a process that is
    gone (killed with its writer) are removed when the next run's buffers are made."""

    def __init__(self, tag: str):
        self.tag = tag
        self.buffers: list = []  # [(path, capacity, uint8 tensor mapping the file)]
        remove_orphaned_buffers()

    def copy_in(self, index: int, storage) -> tuple:
        """Copy the storage's bytes into buffer `index`; (its file, the byte count)."""
        import torch

        nbytes = storage.nbytes()
        if index == len(self.buffers) or self.buffers[index][1] < nbytes:
            path = SHM_ROOT / f"{BUFFER_PREFIX}{self.tag}-{index}"
            capacity = max(nbytes, 1)
            _allocate(path, capacity)
            mapped = torch.from_file(str(path), shared=True, size=capacity, dtype=torch.uint8)
            entry = (path, capacity, mapped)
            if index == len(self.buffers):
                self.buffers.append(entry)
            else:
                self.buffers[index] = entry
        path, _, mapped = self.buffers[index]
        if nbytes:
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            mapped[:nbytes].copy_(source)
        return str(path), nbytes

    @property
    def nbytes(self) -> int:
        return sum(capacity for _, capacity, _ in self.buffers)

    def release(self) -> None:
        for path, _, _ in self.buffers:
            Path(path).unlink(missing_ok=True)
        self.buffers = []


class SnapshotBuffersFull(OSError):
    """/dev/shm could not hold a snapshot buffer: the save falls back to a synchronous one."""


def _allocate(path: Path, capacity: int) -> None:
    """The buffer's file with every page allocated now (posix_fallocate): a /dev/shm that cannot hold it fails here,
    with ENOSPC, where a sparse file would have been a SIGBUS at the first copy into a page that could not be had."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, capacity)
        except (AttributeError, OSError) as err:  # (not Linux, or a file system without it: the file stays sparse)
            if isinstance(err, OSError) and err.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            os.ftruncate(fd, capacity)
    except OSError as err:
        path.unlink(missing_ok=True)
        raise SnapshotBuffersFull(
            err.errno, f"{SHM_ROOT} cannot hold a {capacity / 1e9:.2f} GB snapshot buffer ({err.strerror})"
        ) from err
    finally:
        os.close(fd)


def remove_orphaned_buffers() -> None:
    """Remove the snapshot buffers of processes that no longer run."""
    for path in SHM_ROOT.glob(f"{BUFFER_PREFIX}*"):
        pid = path.name[len(BUFFER_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


class Snapshot:
    """One save's files as taken from DeepSpeed: [(path, pickled structure, zipfile flag)] and the buffers its
    tensors refer to ({index: (file, bytes)})."""

    def __init__(self, buffers: HostBuffers):
        self.host = buffers
        self.files: list = []
        self.buffers: dict = {}
        self._seen: dict = {}  # this file's storages: identity -> buffer index

    def take(self, state_dict, path, zipfile_serialization: bool = True) -> None:
        # Per file: every object of the state dict is alive while it is walked, so no identity is reused (the
        # storages of an earlier file, freed since, may have left their addresses to this one's).
        # id(container or tensor) -> its copy: met twice, it stays one object, as pickle keeps it
        self._memo: dict[int, Any] = {}
        self._seen = {}
        structure = self._walk(state_dict)
        self.files.append((str(path), pickle.dumps(structure, protocol=pickle.HIGHEST_PROTOCOL), zipfile_serialization))

    def _walk(self, obj):
        import torch

        if isinstance(obj, torch.Tensor):
            if id(obj) in self._memo:  # one tensor met twice stays one (pickle writes a reference)
                return self._memo[id(obj)]
            storage = obj.untyped_storage()
            key = storage._cdata  # the storage itself: views share it, distinct empty tensors do not
            if key not in self._seen:
                index = self._seen[key] = len(self.buffers)
                self.buffers[index] = self.host.copy_in(index, storage)
            ref = TensorRef(
                self._seen[key],
                dtype=obj.dtype,
                offset=obj.storage_offset(),
                size=tuple(obj.shape),
                stride=tuple(obj.stride()),
                parameter=isinstance(obj, torch.nn.Parameter),
                requires_grad=obj.requires_grad,
                attributes=self._walk(obj.__dict__) if obj.__dict__ else None,
            )
            self._memo[id(obj)] = ref
            return ref
        return _copy_container(obj, self._walk, self._memo)


def _copy_container(obj, convert, memo: dict):
    """`obj` with `convert` applied to the items of its dicts, lists and tuples (anything else is left as it is). A
    container met twice gives the same copy, and one holding nothing converted is itself: pickle then writes the
    same references as for the original. The copy of a mapping keeps the original's instance attributes (a module
    state dict's `_metadata`, which torch.save keeps and load_state_dict reads)."""
    kind = type(obj)
    if kind not in (dict, OrderedDict, list, tuple):
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    if kind in (dict, OrderedDict):
        items = [(k, convert(v)) for k, v in obj.items()]
        same = all(new is old for (_, new), old in zip(items, obj.values(), strict=True))
        copy = obj if same else kind(items)
        for name, value in getattr(obj, "__dict__", {}).items() if copy is not obj else ():
            setattr(copy, name, value)
    else:
        items = [convert(v) for v in obj]
        copy = obj if all(new is old for new, old in zip(items, obj, strict=True)) else kind(items)
    memo[id(obj)] = copy
    return copy


def rebuild(obj, storages: dict, memo: dict | None = None):
    """The objects of a snapshot's structure, with each TensorRef a tensor on its buffer's storage."""
    import torch

    memo = {} if memo is None else memo
    if isinstance(obj, TensorRef):
        if id(obj) in memo:  # one tensor met twice stays one
            return memo[id(obj)]
        tensor = torch.empty(0, dtype=obj.dtype).set_(storages[obj.index], obj.offset, obj.size, obj.stride)
        if obj.parameter:
            tensor = torch.nn.Parameter(tensor, requires_grad=obj.requires_grad)
        elif obj.requires_grad:
            tensor.requires_grad_(True)
        for name, value in (rebuild(obj.attributes, storages, memo) or {}).items():
            setattr(tensor, name, value)
        memo[id(obj)] = tensor
        return tensor
    return _copy_container(obj, lambda v: rebuild(v, storages, memo), memo)


def write_snapshot(folder: str, files: list, buffers: dict) -> dict:
    """The writer's job: each file written with torch.save as DeepSpeed's checkpoint engine does, and on disk
    (fsync, off the training path) before it is reported written; {path: SHA-256}."""
    import torch

    from scaletrain.checkpoint.commit import file_checksum, sync_to_disk

    storages = {
        index: (
            torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).untyped_storage()
            if nbytes
            else torch.UntypedStorage(0)
        )
        for index, (path, nbytes) in buffers.items()
    }
    checksums = {}
    for path, payload, zipfile_serialization in files:
        torch.save(rebuild(pickle.loads(payload), storages), path, _use_new_zipfile_serialization=zipfile_serialization)
    sync_to_disk([path for path, _, _ in files])
    for path, _, _ in files:
        checksums[path] = file_checksum(Path(path))
    return checksums


@contextmanager
def _preemption_signals_ignored() -> Iterator[None]:
    """SIGUSR1 and SIGTERM ignored while the writer is spawned (an ignored signal stays ignored across exec), so a
    preemption signal to the whole job cannot end a writer still importing torch, before writer_main ignores it.
    Off the main thread, where handlers cannot be set, writer_main alone does."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: not set from Python


def writer_main(conn) -> None:
    """The writer process: one snapshot at a time from `conn`, answered ("done", {path: checksum}, seconds) or
    ("failed", path, why); ends at None or when the rank is gone (EOF)."""
    import signal

    import torch

    from scaletrain.checkpoint.commit import describe_write_failure, is_write_failure

    # A preemption signal reaches every process (Slurm's --signal, DeepSpeed's launcher's SIGTERM to the tree) but is
    # the rank's to act on: it waits for this write before its preemption save.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    try:  # ready (torch imported): `ps -o comm` shows it so (operators; tests that wait for it)
        Path("/proc/self/comm").write_text(WRITER_NAME)
    except OSError:
        pass
    known: set = set()  # the rank's buffer files: removed here when the rank is gone without closing (a kill -9)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            for path in known:
                Path(path).unlink(missing_ok=True)
            return
        if job is None:
            gc.freeze()  # nothing left to write: spare the interpreter's last collection (a second or so at exit)
            return
        folder, files, buffers = job
        known.update(path for path, _ in buffers.values())
        started = time.perf_counter()
        try:
            conn.send(("done", write_snapshot(folder, files, buffers), time.perf_counter() - started))
        except (OSError, RuntimeError) as err:
            if not is_write_failure(err):
                conn.send(("failed", folder, f"{type(err).__name__}: {err}"))
            else:
                conn.send(("failed", folder, describe_write_failure(err, Path(folder))))


@dataclass
class InFlight:
    """The save being written in the background."""

    tag: str
    tmp: Path
    step: int
    previous: Path | None  # the newest committed checkpoint when it started (what a failure leaves intact)
    own_checksums: dict  # this rank's files written before the snapshot went (RNG state, train state)
    started: float
    result: tuple | None = None  # the writer's answer once it came


class BackgroundWriter:
    """This rank's writer process and the save in flight."""

    def __init__(self, rank: int):
        self.rank = rank
        self.buffers = HostBuffers(f"{os.getpid()}-rank{rank}")
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.in_flight: InFlight | None = None

    def snapshot(self) -> Snapshot:
        return Snapshot(self.buffers)

    def start(self) -> None:
        import multiprocessing

        if self.process is not None and self.process.is_alive():
            return
        atexit.register(self.close)  # before multiprocessing's own exit hook, which would wait for ever on the writer
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=writer_main, args=(child,), daemon=True, name="scaletrain-writer")
        with _preemption_signals_ignored():  # inherited through the exec: from the writer's first instruction
            self.process.start()
        child.close()

    def submit(self, in_flight: InFlight, snapshot: Snapshot) -> None:
        self.start()
        self.in_flight = in_flight
        assert self.conn is not None  # start() made the pipe
        self.conn.send((str(in_flight.tmp), snapshot.files, snapshot.buffers))

    def status(self, wait: bool = False) -> str:
        """ "writing", "done" or "failed" for the save in flight (`wait`: until it is no longer writing)."""
        flight = self.in_flight
        assert flight is not None  # only asked while a save is in flight
        if flight.result is None:
            conn, process = self.conn, self.process
            assert conn is not None and process is not None  # submit() started the writer and its pipe
            try:
                if conn.poll(None if wait else 0):
                    flight.result = conn.recv()
                elif not process.is_alive():
                    flight.result = (
                        "failed",
                        str(flight.tmp),
                        f"its writer process died (exit {process.exitcode})",
                    )
            except (EOFError, OSError):
                process.join(timeout=5)
                flight.result = ("failed", str(flight.tmp), f"its writer process died (exit {process.exitcode})")
        return "writing" if flight.result is None else flight.result[0]

    def close(self) -> None:
        """The writer ends (a write in flight gets 10 s to finish) and the buffers go. An idle writer is killed at
        once: it holds nothing, and waiting for one still importing torch costs a short run over a second."""
        if self.process is not None:
            writing = self.in_flight is not None and self.in_flight.result is None
            if writing:
                assert self.conn is not None  # made with the process, in start()
                try:
                    self.conn.send(None)
                except OSError:
                    pass
                self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.process = None
        self.buffers.release()


def snapshot_refusal(
    per_rank_bytes: int, ranks_on_host: int, available: int | None = None, shm_free=None, cgroup=MEASURED
):
    """Why this host cannot hold the snapshot buffers (None: it can): every rank of the host keeps a host copy of its
    share of the checkpoint, in /dev/shm; together they must fit in half of the memory available now (the host's, and
    under a memory cgroup, a Slurm job's or a container's, what its limit leaves: /dev/shm pages are charged to it,
    and a job over its limit is killed, not refused) and in /dev/shm's free space. `available`, `shm_free`, `cgroup`
    (a CgroupMemory or None): measured here unless given."""
    import psutil

    from scaletrain.observability import CgroupMemory

    needed = per_rank_bytes * ranks_on_host
    available = psutil.virtual_memory().available if available is None else available
    cgroup = CgroupMemory.of_this_process() if cgroup is MEASURED else cgroup
    if shm_free is None:
        try:
            shm_free = shutil.disk_usage(SHM_ROOT).free
        except OSError:
            return f"{SHM_ROOT} is missing"
    what = f"the snapshot buffers of this host's {ranks_on_host} rank(s) need {needed / 1e9:.2f} GB"
    limit = "none"
    if cgroup is not None:
        limit = f"{cgroup.path} (limit {cgroup.limit / 1e9:.2f} GB, in use {cgroup.in_use / 1e9:.2f} GB)"
    log.debug(
        f"{what}; host memory available {available / 1e9:.2f} GB, {SHM_ROOT} free {shm_free / 1e9:.2f} GB; "
        f"memory cgroup: {limit}"
    )
    if cgroup is not None and cgroup.free < available:
        if needed > cgroup.free / 2:
            return (
                f"{what}, more than half of the {cgroup.free / 1e9:.2f} GB that the job's memory limit "
                f"({cgroup.limit / 1e9:.2f} GB, cgroup {cgroup.path}) leaves free"
            )
    elif needed > available / 2:
        return f"{what}, more than half of the {available / 1e9:.2f} GB of host memory available"
    if needed > shm_free * 0.9:
        return f"{what}, and {SHM_ROOT} has {shm_free / 1e9:.2f} GB free"
    return None
