"""One DistInfo for every launcher (deepspeed, torchrun, srun, plain python), gathered once and passed down.

`read_launch_env` reads the environment only (no torch), so a bad flag is found before any process group exists.
`init_distributed` then builds the process group through DeepSpeed (every rank joins it, even one whose pre-flight
failed, to tell the others: scaletrain.distributed.agreement).
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import logging
import os
import socket
from collections.abc import Mapping

from scaletrain.distributed.layout import describe_groups, rank_ranges
from scaletrain.config import ResolvedDSConfig
from scaletrain.parts import DistInfo

log = logging.getLogger(__name__)


def read_launch_env(environ: Mapping[str, str] | None = None) -> DistInfo:
    """Rank facts from whichever launcher started us. Launcher variables win over Slurm's.

    torchrun and the deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK. `srun python train.py` sets only
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, which torch.distributed does not read, so they are mapped here.
    A Slurm batch step with one task (srun running a launcher per node) is not itself a rank: SLURM_NTASKS=1.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo.launched(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            launcher="torchrun/deepspeed",
        )
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return DistInfo.launched(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=int(env["SLURM_NTASKS"]),
            launcher="srun",
        )
    return DistInfo.launched(rank=0, local_rank=0, world_size=1, launcher="single")


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous, or a launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export_rendezvous_env(dist: DistInfo) -> None:
    """torch.distributed's env:// init needs these; launchers set them, srun and plain python do not."""
    os.environ.setdefault("RANK", str(dist.rank))
    os.environ.setdefault("LOCAL_RANK", str(dist.local_rank))
    os.environ.setdefault("WORLD_SIZE", str(dist.world_size))
    if dist.launcher == "single":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    elif dist.launcher == "srun":
        # `srun python train.py`: every task derives the same address (the job's first node) and port (from the
        # job id), so no script has to export them; values already in the environment win.
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = first_node(os.environ.get("SLURM_JOB_NODELIST", ""))
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def first_node(nodelist: str) -> str:
    """The first host name of a Slurm node list ("n[1-4],gpu7" -> "n1"), expanded by Slurm's own scontrol."""
    import subprocess

    if not nodelist:
        raise RuntimeError("srun launch: no SLURM_JOB_NODELIST; set MASTER_ADDR to the first node of the job")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(
            f"srun launch: cannot expand SLURM_JOB_NODELIST={nodelist} with scontrol ({err}); "
            "set MASTER_ADDR to the first node of the job"
        ) from err
    return out[0]


# Hugging Face's --ddp_timeout default; a rank whose pre-flight failed joins the others with it (its flags unread).
DEFAULT_DDP_TIMEOUT_S = 1800.0


def init_distributed(dist: DistInfo, timeout_s: float = DEFAULT_DDP_TIMEOUT_S) -> DistInfo:
    """Create the process group (gloo on CPU, nccl on CUDA) and bind this rank to its device. `timeout_s`
    (--ddp_timeout): how long a collective waits before it raises; DeepSpeed 0.19.8's own default is 10 minutes."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _export_rendezvous_env(dist)
    accelerator = get_accelerator().device_name()
    if accelerator == "cpu" and dist.world_size == 1:
        # DeepSpeed JIT-builds its shared-memory all-reduce op on every CPU start (tens of seconds to minutes
        # on a fresh machine). A single rank never communicates, so skip the build.
        from scaletrain.engine import skip_shm_op_build

        skip_shm_op_build()
    elif accelerator == "cpu":
        from scaletrain.engine import comm_ops, load_ops

        load_ops(comm_ops(accelerator, dist.world_size))  # under our lock; DeepSpeed then finds it loaded
    if accelerator == "cpu":
        share_cpu_cores()
    backend = "gloo" if accelerator == "cpu" else get_accelerator().communication_backend_name()
    if accelerator != "cpu":
        get_accelerator().set_device(dist.local_rank)
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    _start_object_group(backend, datetime.timedelta(seconds=timeout_s))
    return dataclasses.replace(dist, accelerator=accelerator)


# The shared-memory kernel is 3-14x faster than gloo at every size from 64 KB to 64 MB on this 2-core box
# (BENCHMARKS.md, "gloo against shared memory"), but a rank waiting in it for a dead peer spins until the launcher
# kills it, where gloo raises (and the run says which peer is gone). So only gradient buckets (a model's are MBs)
# take it; the small all-reduces of norms and flags, where most waits on a failed rank happen, stay on gloo.
SHM_MIN_BYTES = 2**20


def shm_allreduce_refusal(dist: DistInfo, local_sizes: list, cores: int, usable: list) -> str | None:
    """Why --cpu_shm_allreduce cannot be used by this launch (None: it can), from what every rank found (in rank
    order): its LOCAL_SIZE, whether DeepSpeed's kernel is loaded there, and the distinct cores the ranks may run on
    together. The kernel maps every rank's buffer into shared memory only when LOCAL_SIZE (the deepspeed launcher's
    ranks on this host) is the world size, and its ranks wait for each other by spinning: never more ranks than
    cores. Decided on the same facts on every rank: no all-reduce meets gloo on one rank and the kernel on another."""
    if dist.accelerator != "cpu":
        return f"the {dist.accelerator} backend's collectives are used"
    if dist.world_size == 1:
        return "one rank"
    for rank, local_size in enumerate(local_sizes):
        if local_size != str(dist.world_size):
            return (
                f"the kernel needs every rank on one host, launched by the deepspeed launcher (rank {rank}: "
                f"LOCAL_SIZE {local_size or 'unset'}, world size {dist.world_size})"
            )
    if dist.world_size > cores:
        return f"{dist.world_size} ranks on {cores} cores: its ranks spin while they wait, one core each"
    for rank, loaded in enumerate(usable):
        if not loaded:
            return f"rank {rank}: DeepSpeed's kernel is not loaded, or the CPU lacks AVX2"
    return None


def use_shm_allreduce(dist: DistInfo):
    """Large gradient all-reduces through DeepSpeed's shared-memory kernel where shm_allreduce_refusal allows: the
    installed ds_internals.ShmAllReduce (its counters say how much it carried), or None with the reason logged.
    A collective on CPU ranks (every rank's facts); nothing to do, and no collective, on a GPU or a single rank."""
    from scaletrain.engine import ShmAllReduce

    if dist.accelerator != "cpu" or dist.world_size == 1:
        return None
    router = ShmAllReduce(dist.world_size, SHM_MIN_BYTES)
    facts = all_gather_objects((os.environ.get("LOCAL_SIZE"), sorted(os.sched_getaffinity(0)), router.usable))
    cores = len(set().union(*(set(affinity) for _, affinity, _ in facts)))
    refusal = shm_allreduce_refusal(dist, [size for size, _, _ in facts], cores, [ok for _, _, ok in facts])
    if refusal is not None:
        log.info("cpu: all-reduce through gloo (--cpu_shm_allreduce: %s)", refusal)
        return None
    router.install()
    log.info(
        "cpu: all-reduces of %d MB or more over all %d ranks through DeepSpeed's shared-memory kernel, the "
        "rest through gloo (--no-cpu_shm_allreduce: gloo for all)",
        SHM_MIN_BYTES // 2**20,
        dist.world_size,
    )
    return router


def cpu_threads_per_rank(environ: Mapping[str, str], cores: int) -> int | None:
    """Intra-op threads for each CPU rank: the node's cores shared among its ranks, unless OMP_NUM_THREADS is set.

    torch's default is one thread per core in every process, so n ranks on a node run n x cores threads that
    preempt each other (and gloo's threads) in every matrix product. torchrun sets OMP_NUM_THREADS=1 for several
    ranks; the deepspeed launcher sets it only with --bind_cores_to_rank; srun never."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    local_ranks = int(
        environ.get("LOCAL_WORLD_SIZE")
        or environ.get("LOCAL_SIZE")
        or environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
        or 1
    )
    return max(1, cores // max(1, local_ranks))


def share_cpu_cores() -> None:
    import torch

    threads = cpu_threads_per_rank(os.environ, len(os.sched_getaffinity(0)))
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)  # describe_launch says it


def rank_hosts() -> list:
    """Every rank's host name, in rank order (a collective): where the ranks actually landed."""
    import socket

    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return [socket.gethostname()]
    hosts = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any (a collective; without a process group, the flag)."""
    return bool(max_over_ranks(1.0 if flag else 0.0))


def every_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on all of them (a collective; without a process group, the flag)."""
    return not any_rank(not flag)


def max_over_ranks(value: float) -> float:
    """The largest of every rank's `value`, on every rank (a collective; without a process group, the value)."""
    import torch
    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return value
    from deepspeed.accelerator import get_accelerator

    tensor = torch.tensor([float(value)], device=get_accelerator().current_device_name())
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor.item()


_OBJECT_GROUP = None  # where objects travel: None (the default group) under gloo, a gloo group beside NCCL


def _start_object_group(backend: str, timeout) -> None:
    """Objects (verdicts, decisions) travel over gloo: a peer that died closes its sockets, so a gloo collective
    fails at once where an NCCL one would wait for its timeout; and they need no device copies. Called by every
    rank at the same point (new_group is a collective)."""
    global _OBJECT_GROUP
    import torch.distributed as torch_dist

    _OBJECT_GROUP = None if backend == "gloo" else torch_dist.new_group(backend="gloo", timeout=timeout)


def _grouped() -> bool:
    import torch.distributed as torch_dist

    return torch_dist.is_available() and torch_dist.is_initialized()


def all_gather_objects(value) -> list:
    """Every rank's `value`, in rank order (a collective; without a process group, [value])."""
    if not _grouped():
        return [value]
    import torch.distributed as torch_dist

    gathered = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, value, group=_OBJECT_GROUP)
    return gathered


def broadcast_from_main(value):
    """Global rank 0's `value` on every rank (a collective; without a process group, `value`): a decision taken
    once, so that ranks reading a shared file system at different moments cannot take different ones."""
    if not _grouped():
        return value
    import torch.distributed as torch_dist

    box = [value]
    torch_dist.broadcast_object_list(box, src=0, group=_OBJECT_GROUP)
    return box[0]


def barrier() -> None:
    import deepspeed.comm as ds_comm

    ds_comm.barrier()


def process_group_timeout() -> float | None:
    """The default process group's timeout in seconds, as torch holds it (None where it cannot be read)."""
    import torch
    import torch.distributed as torch_dist

    try:
        group = torch_dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def teardown_distributed(rank: int = 0) -> None:
    global _OBJECT_GROUP
    import torch.distributed as torch_dist

    _OBJECT_GROUP = None  # destroyed with the others below; no reference may keep its gloo threads alive
    if torch_dist.is_available() and torch_dist.is_initialized():
        import deepspeed.comm as ds_comm

        # DeepSpeed's own destroy also drops the groups it caches (deepspeed.utils.groups); torch's alone would
        # leave them, and their gloo threads, to be torn down while the interpreter exits.
        ds_comm.destroy_process_group()
        gc.collect()  # groups held only through reference cycles end here, not at exit
    remove_shm_buffer(rank)


def communication_threads() -> int:
    """How many gloo threads this process runs (a live gloo process group keeps some); 0 where /proc is absent."""
    names = []
    for task in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(task) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def remove_shm_buffer(rank: int) -> None:
    """Unlink this rank's DeepSpeed shared-memory all-reduce buffer (CPU ranks).

    DeepSpeed's shm comm op creates /dev/shm/deepspeed_allreduce_buffer_<...>_<addr>_<port>_<rank> (69 MB) and
    never unlinks it: every CPU run with several ranks would leave its buffers in RAM-backed /dev/shm until the
    machine runs out of memory. The peers mapped it at start-up, so removing the name at the end is safe.
    (A rank killed with SIGKILL cannot clean up; .ci/run clears leftovers before the tests.)
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}"):
        try:
            os.unlink(path)
        except OSError:
            pass


def describe_launch(dist: DistInfo, *, ds: ResolvedDSConfig, config_path: str, attention: str) -> list:
    """The first lines of a run's log: where the ranks landed and the layout, then what each of them runs with
    (`attention`: the backend and who chose it). Each rank's host, in rank order (gathered here, a collective)."""
    hosts = rank_hosts()
    placement = ", ".join(
        f"{host} (ranks {rank_ranges([r for r, h in enumerate(hosts) if h == host])})" for host in dict.fromkeys(hosts)
    )
    groups = describe_groups(dist.layout, hosts)
    log.info(
        f"launch: {dist.launcher}, world size {dist.world_size} on {len(set(hosts))} host(s): {placement}; layout: "
        f"{dist.layout.describe()}{f'; {groups}' if groups else ''}"
    )
    if dist.accelerator == "cpu":
        import torch

        log.info(
            "accelerator: cpu (DeepSpeed found no GPU), %d intra-op thread(s) per rank (this node's cores shared "
            "among its ranks; OMP_NUM_THREADS overrides)",
            torch.get_num_threads(),
        )
    else:
        log.info("accelerator: %s", dist.accelerator)
    log.info("precision: %s (%s)", ds.precision, ds.precision_reason)
    log.info("attention: %s", attention)
    log.info("DeepSpeed config %s: %s", config_path, ds.summary())
    log.debug("resolved DeepSpeed config (%s):\n%s", config_path, ds.explained())
    return hosts
